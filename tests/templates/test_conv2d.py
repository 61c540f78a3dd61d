"""The conv2d family on the CPU: its packing and torch reference against ``F.conv2d`` of the masked weight at odd
shapes, densities 0 to 1; the CUDA kernels built through TVM and nvcc (no GPU: the GPU runs are
``tests/runtime/test_cuda_conv2d.py``)."""

import json

import pytest
import torch
import torch.nn.functional as F

from sparta.templates.conv2d.spec import (Conv2dError, Conv2dSpec, block_mask_of, check_inputs, conv2d_ref,
                                          expand_block_mask, pack_weight)

SHAPES = {   # odd channel counts (not multiples of the block), 7x7 inputs, strides, padding, dilation, 1x1
    "3x3_s2_p1": dict(cin=40, cout=72, h=7, w=7, kh=3, kw=3, stride=2, padding=1, bn=32, bk=32, tm=64, warps_m=2),
    "3x3_s1_p1_b64": dict(cin=96, cout=80, h=9, w=7, kh=3, kw=3, stride=1, padding=1, bn=64, bk=64, tm=128,
                          warps_m=2, warps_n=2),
    "5x5_d2_p3": dict(cin=24, cout=50, h=11, w=10, kh=5, kw=5, stride=1, padding=3, dilation=2, bn=32, bk=16,
                      tm=64, warps_m=2),
    "1x1_s2": dict(cin=56, cout=33, h=7, w=7, kh=1, kw=1, stride=2, padding=0, bn=16, bk=32, tm=32, warps_m=2),
    "7x3_rect": dict(cin=16, cout=24, h=13, w=8, kh=7, kw=3, stride=(2, 1), padding=(3, 1), bn=32, bk=16, tm=64,
                     warps_m=2),
}


def _blocks(spec, density, seed):
    g = torch.Generator().manual_seed(seed)
    if density >= 1:
        return torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool)
    return torch.rand(spec.row_blocks, spec.k_blocks, generator=g) < density


def _data(spec, nb, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nb, spec.h, spec.w, spec.cin, generator=g).to(dtype)
    w = torch.randn(spec.cout, spec.cin, spec.kh, spec.kw, generator=g).to(dtype)
    b = torch.randn(spec.cout, generator=g).to(dtype)
    r = torch.randn(nb, spec.oh, spec.ow, spec.cout, generator=g).to(dtype)
    return x, w, b, r


def simulate(x, wp, table, spec, bias, residual):
    """The kernel's data flow in torch: per block row, per table entry, the tap's strided window of the padded input
    times the packed block; then bias, residual, activation."""
    from sparta.templates.epilogue_ref import activate
    nb = x.shape[0]
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    xp = F.pad(x.float(), (0, spec.cin_blocks * spec.bk - spec.cin, pw, pw, ph, ph))
    y = torch.zeros(nb, spec.oh, spec.ow, spec.row_blocks * spec.bn)
    head = spec.row_blocks + 1
    for row in range(spec.row_blocks):
        for j in range(int(table[row]), int(table[row + 1])):
            kb = int(table[head + j])
            tap, cb = divmod(kb, spec.cin_blocks)
            r, s = divmod(tap, spec.kw)
            win = xp[:, r * dh: r * dh + (spec.oh - 1) * sh + 1: sh, s * dw: s * dw + (spec.ow - 1) * sw + 1: sw,
                     cb * spec.bk: (cb + 1) * spec.bk]
            y[..., row * spec.bn: (row + 1) * spec.bn] += win @ wp[j].float().t()
    y = y[..., :spec.cout] + (bias.float() if bias is not None else 0)
    if residual is not None:
        y = y + residual.float()
    return activate(y, spec.act)


@pytest.mark.parametrize("density", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_packed_blocks_and_the_reference_compute_the_masked_convolution(shape, density):
    spec = Conv2dSpec(**SHAPES[shape], act="relu", residual=True)
    x, w, b, r = _data(spec, 3, seed=len(shape))
    blocks = _blocks(spec, density, seed=7)
    masked = w * expand_block_mask(blocks, spec)
    want = F.relu(F.conv2d(x.permute(0, 3, 1, 2), masked, b, spec.stride, spec.padding, spec.dilation)
                  .permute(0, 2, 3, 1) + r)
    got = conv2d_ref(x, w, blocks, b, spec, r)
    assert got.shape == (3, spec.oh, spec.ow, spec.cout)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    wp, table = pack_weight(masked, spec, blocks)
    assert int(table[spec.row_blocks]) == int(blocks.sum()) and len(table) == spec.row_blocks + 1 + int(blocks.sum())
    assert wp.shape[0] == max(1, int(blocks.sum()))
    torch.testing.assert_close(simulate(x, wp, table, spec, b, r), want, rtol=1e-4, atol=1e-4)
    if 0 < density < 1:
        assert torch.equal(block_mask_of(masked, spec), blocks & block_mask_of(w, spec))


def test_an_all_pruned_weight_outputs_the_activated_bias_and_residual():
    spec = Conv2dSpec(**SHAPES["3x3_s2_p1"], act="silu", residual=True)
    x, w, b, r = _data(spec, 2, seed=3)
    blocks = torch.zeros(spec.row_blocks, spec.k_blocks, dtype=torch.bool)
    wp, table = pack_weight(w, spec, blocks)
    want = F.silu(b + r)
    torch.testing.assert_close(conv2d_ref(x, w, blocks, b, spec, r), want)
    torch.testing.assert_close(simulate(x, wp, table, spec, b, r), want)


def test_specs_and_inputs_the_kernel_cannot_run_are_refused():
    with pytest.raises(Conv2dError, match="multiple of 8"):
        Conv2dSpec(cin=20, cout=32, h=7, w=7)
    with pytest.raises(Conv2dError, match="groups"):
        Conv2dSpec(cin=32, cout=32, h=7, w=7, groups=2)
    with pytest.raises(Conv2dError, match="shared memory"):
        Conv2dSpec(cin=64, cout=128, h=7, w=7, bn=128, bk=64, tm=256, warps_m=8, stages=6)
    with pytest.raises(Conv2dError, match="does not fit"):
        Conv2dSpec(cin=8, cout=16, h=2, w=2, kh=5, kw=5, padding=0, bn=16, bk=16, tm=32, warps_m=2)
    spec = Conv2dSpec(**SHAPES["1x1_s2"], dtype="float16")
    x = torch.zeros(2, spec.h, spec.w, spec.cin, dtype=torch.float16)
    assert check_inputs(spec, x, None) == 2
    with pytest.raises(Conv2dError, match="float16"):
        check_inputs(spec, x.float(), None)
    with pytest.raises(Conv2dError, match="residual"):
        check_inputs(spec, x, torch.zeros(2, spec.oh, spec.ow, spec.cout, dtype=torch.float16))


BUILDS = {
    "odd_relu_res": Conv2dSpec(**SHAPES["3x3_s2_p1"], act="relu", residual=True),
    "b64_bf16_silu": Conv2dSpec(**SHAPES["3x3_s1_p1_b64"], act="silu", dtype="bfloat16"),
    "1x1_odd_cout_nobias": Conv2dSpec(**SHAPES["1x1_s2"], bias=False),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_kernels_build_through_tvm_and_nvcc(name):
    pytest.importorskip("tvm")
    from sparta.codegen.cuda_build import build_cuda
    from sparta.templates.conv2d.kernel import conv2d_kernel
    spec = Conv2dSpec(**{**BUILDS[name].key(), "name": f"cv_{name}"})
    art = build_cuda(conv2d_kernel, spec)
    launch = art.launch
    assert launch["grid"] == [["M", spec.tm], spec.row_blocks, 1] and launch["block"] == [spec.threads, 1, 1]
    assert launch["shared_bytes"] == spec.shared_bytes and set(launch["cubins"]) == {"sm_80", "sm_90"}
    names = {a["name"] for a in launch["args"]}
    assert {"X", "Wp", "Tab", "Y", "M"} <= names
    assert ("B" in names) == spec.bias and ("RR" in names) == spec.residual
    source = (art.path / "kernel.cu").read_text()
    mma = "bf16.bf16" if spec.dtype == "bfloat16" else "f16.f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{mma}.f32" in source and "cp.async" in source
    assert json.loads((art.path / "spec.json").read_text())["cin"] == spec.cin
