"""The FP8 GEMV family without a GPU: quantisation and packing round trips at odd shapes, dense and block-sparse at 0 to
100% kept blocks (and a hypothesis property), the torch reference, an emulation of the kernel's arithmetic (E4M3 →
fp16 → fp32, the lanes' fp32 sums, the warps', the splits', scale, bias, activation) on the packed tensors against
the reference, the family's errors, the kernel module's fake, saved form and op, and CUDA builds through TVM + nvcc."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparta.errors import SpartaError
from sparta.runtime.cuda import CudaRuntimeError
from sparta.templates.epilogue_ref import activate
from sparta.templates.fp8_gemv.spec import (BLOCK, FP8_MAX, Fp8GemvError, Fp8GemvSpec, Fp8Packed, bytes_read,
                                            check_packed, dequantize, element_mask, expand_scales, fp8_gemv_ref,
                                            pack_codes, pack_weight, quantize, split_buffers, suggest_ksplit, unpack)

from fixtures.fp8_data import block_mask, weight

needs_build = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
SHAPES = [(77, 200), (130, 1000), (1, 8), (33, 1031), (257, 129)]


def spec_for(n, k, density, **knobs):
    return Fp8GemvSpec(n, k, sparse=density < 1.0 or knobs.pop("sparse", False), **knobs)


@pytest.mark.parametrize("scale", ["channel", "block"])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("n, k", SHAPES)
def test_quantise_pack_unpack_round_trip(n, k, density, scale):
    spec = spec_for(n, k, density, scale=scale)
    w, mask = weight(n, k, seed=n + k), block_mask(n, k, density, seed=n)
    bm = mask if spec.sparse else None
    codes, scales = quantize(w, spec, bm)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == spec.scale_shape and bool((scales > 0).all())
    keep = element_mask(mask if spec.sparse else torch.ones_like(mask), n, k)
    s = expand_scales(scales, spec)
    want = (torch.where(keep, w.float(), torch.zeros(())) / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))       # torch's round to nearest
    assert float(codes.float().abs().max()) <= FP8_MAX
    packed = pack_codes(codes, scales, spec, bm)
    got, got_mask = unpack(packed, spec)
    if spec.sparse:
        assert torch.equal(got_mask, mask)
    kept_codes = torch.where(keep, codes.float(), torch.zeros(()))
    assert torch.equal(got.float(), kept_codes)
    deq = dequantize(packed, spec)
    wk = torch.where(keep, w.float(), torch.zeros(()))
    assert bool(((deq - wk).abs() <= wk.abs() / 16 + s * 2.0 ** -9).all())       # E4M3: 3 mantissa bits
    blocks = int(mask.sum()) if spec.sparse else spec.row_blocks * spec.col_blocks
    assert packed.codes.numel() * 4 == max(blocks, 1) * BLOCK * BLOCK
    assert (packed.table is not None) == spec.sparse


def test_no_block_kept_and_every_block_kept():
    n, k = 70, 100
    w = weight(n, k)
    none = Fp8GemvSpec(n, k, sparse=True)
    packed = pack_weight(w, none, block_mask(n, k, 0.0))
    assert packed.codes.numel() == BLOCK * BLOCK // 4 and int(packed.table[none.row_blocks]) == 0
    assert not dequantize(packed, none).any() and bool((packed.scales == 1).all())
    full = Fp8GemvSpec(n, k, sparse=True)
    dense = Fp8GemvSpec(n, k)
    a = dequantize(pack_weight(w, full, block_mask(n, k, 1.0)), full)
    assert torch.equal(a, dequantize(pack_weight(w, dense), dense))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 100), k=st.integers(1, 300), density=st.floats(0, 1), block=st.booleans(),
       fp16=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_pack_unpack_property(n, k, density, block, fp16, seed):
    spec = spec_for(n, k, density, scale="block" if block else "channel")
    w = weight(n, k, torch.float16 if fp16 else torch.bfloat16, seed)
    mask = block_mask(n, k, density, seed)
    bm = mask if spec.sparse else None
    codes, scales = quantize(w, spec, bm)
    packed = pack_codes(codes, scales, spec, bm)
    got, got_mask = unpack(packed, spec)
    keep = element_mask(mask if spec.sparse else torch.ones_like(mask), n, k)
    assert torch.equal(got.float(), torch.where(keep, codes.float(), torch.zeros(())))
    assert not spec.sparse or torch.equal(got_mask, mask)
    assert torch.equal(packed.scales, scales)


@pytest.mark.parametrize("act", ["none", "relu", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_is_the_dequantised_linear_and_near_the_16_bit_one(act, dtype):
    n, k = 77, 200
    spec = Fp8GemvSpec(n, k, rows=5, dtype="float16" if dtype == torch.float16 else "bfloat16", bias=True, act=act)
    w = weight(n, k, dtype)
    bias = torch.randn(n).to(dtype) * 0.1
    x = torch.randn(2, 3, k).to(dtype)
    packed = pack_weight(w, spec)
    got = fp8_gemv_ref(x, packed, spec, bias)
    assert got.shape == (2, 3, n) and got.dtype == dtype
    want = activate(x.float() @ dequantize(packed, spec).t() + bias.float(), act).to(dtype)
    assert torch.equal(got, want)
    exact = activate(x.float() @ w.float().t() + bias.float(), act)
    err = (got.float() - exact).norm() / exact.norm()
    assert err < 0.05, f"E4M3 per-channel: relative error {err:.3g}"


def emulate(spec: Fp8GemvSpec, packed: Fp8Packed, x: torch.Tensor, bias=None) -> torch.Tensor:
    """The kernel's arithmetic on the packed tensors: per CTA (block row, split) and warp, its blocks in round-robin
    order; each lane (row ``16i + lane // 2``, columns ``16 (lane % 2)`` onward) adds code (E4M3 → fp16 → fp32) × X
    in fp32 column by column (``scale="block"``: a block's sum times its scale); the lane pair, the warps and the
    splits add in order; then scale, bias, activation."""
    NBR, KB, W, KS = spec.row_blocks, spec.col_blocks, spec.warps, spec.ksplit
    m = x.shape[0]
    blocks = packed.codes.view(torch.uint8).view(-1, BLOCK, BLOCK).view(torch.float8_e4m3fn)
    wf = blocks.to(torch.float16).float().view(-1, BLOCK, 2, 16)             # block, row, half, column
    xp = torch.zeros(m, KB * BLOCK)
    xp[:, :spec.k] = x.float()
    table = packed.table
    y = torch.zeros(m, NBR * BLOCK)
    for rb in range(NBR):
        parts = []
        for ks in range(KS):
            if spec.sparse:
                count = int(table[rb + 1] - table[rb])
                chunk = -(-count // KS)
                lo = min(ks * chunk, count)
                first, cnt = int(table[rb]) + lo, min(chunk, count - lo)
            else:
                chunk = -(-KB // KS)
                lo = min(ks * chunk, KB)
                first, cnt = rb * KB + lo, min(chunk, KB - lo)
            red = []
            for warp in range(W):
                acc = torch.zeros(BLOCK, 2, m)
                for j in range(warp, cnt, W):
                    col = int(table[NBR + 1 + first + j]) if spec.sparse else lo + j
                    xs = xp[:, col * BLOCK:(col + 1) * BLOCK].view(m, 2, 16)
                    if spec.scale == "block":
                        pb = torch.zeros(BLOCK, 2, m)
                        for e in range(16):
                            pb = pb + wf[first + j, :, :, e, None] * xs[None, :, :, e].permute(0, 2, 1)
                        acc = acc + pb * float(packed.scales[rb // 4, col // 4])
                    else:
                        for e in range(16):
                            acc = acc + wf[first + j, :, :, e, None] * xs[None, :, :, e].permute(0, 2, 1)
                red.append(acc[:, 0] + acc[:, 1])                             # the lane pair's shuffle
            tot = red[0]
            for r in red[1:]:
                tot = tot + r
            parts.append(tot)
        tot = parts[0]
        for p in parts[1:]:
            tot = tot + p
        y[:, rb * BLOCK:(rb + 1) * BLOCK] = tot.t()
    y = y[:, :spec.n]
    if spec.scale == "channel":
        y = y * packed.scales
    if spec.bias:
        y = y + bias.float()
    return activate(y, spec.act).to(x.dtype)


@pytest.mark.parametrize("n, k, density, knobs", [
    (77, 200, 1.0, dict(rows=3, bias=True, act="gelu")),
    (130, 1000, 0.3, dict(rows=16, ksplit=3, warps=2, dtype="float16", bias=True, act="silu")),
    (65, 203, 1.0, dict(rows=2, dtype="float16", inflight=1, ksplit=2)),
    (100, 520, 0.5, dict(rows=4, scale="block", warps=8, inflight=8, bias=True, act="relu")),
    (300, 700, 1.0, dict(rows=1, scale="block", ksplit=4)),
    (40, 300, 0.0, dict(rows=2, bias=True, ksplit=2)),
    (33, 1031, 1.0, dict(rows=5, sparse=True, warps=1)),
])
def test_kernel_arithmetic_gives_the_reference(n, k, density, knobs):
    spec = spec_for(n, k, density, **knobs)
    dtype = torch.float16 if spec.dtype == "float16" else torch.bfloat16
    w, mask = weight(n, k, seed=k), block_mask(n, k, density, seed=k)
    bias = (torch.randn(n) * 0.1).to(dtype) if spec.bias else None
    packed = pack_weight(w, spec, mask if spec.sparse else None)
    x = torch.randn(spec.rows, k).to(dtype)
    got = emulate(spec, packed, x, bias).float()
    want = fp8_gemv_ref(x, packed, spec, bias).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if density == 0.0:
        assert torch.equal(want, activate(bias.float().expand(spec.rows, n), spec.act).to(dtype).float())


@pytest.mark.parametrize("kw, words", [
    (dict(n=0, k=8), "positive"), (dict(n=8, k=8, rows=17), "rows=17"), (dict(n=8, k=8, dtype="float32"), "dtype"),
    (dict(n=8, k=8, act="tanh"), "activation"), (dict(n=8, k=8, scale="tensor"), "scale"),
    (dict(n=8, k=8, warps=3), "warps=3"), (dict(n=8, k=8, inflight=3), "inflight=3"),
    (dict(n=8, k=64, ksplit=3), "ksplit=3"), (dict(n=8, k=8, trigger="now"), "trigger"),
])
def test_bad_specs_are_refused_with_the_reason(kw, words):
    with pytest.raises(Fp8GemvError, match=words) as info:
        Fp8GemvSpec(**kw)
    assert isinstance(info.value, SpartaError)


def test_bad_weights_codes_scales_and_masks_are_refused():
    n, k = 64, 96
    dense, sparse = Fp8GemvSpec(n, k), Fp8GemvSpec(n, k, sparse=True)
    w = weight(n, k)
    with pytest.raises(Fp8GemvError, match="must be \\(N, K\\)"):
        quantize(w[:, :64], dense)
    with pytest.raises(Fp8GemvError, match="16- or 32-bit"):
        quantize(w.to(torch.int8), dense)
    with pytest.raises(Fp8GemvError, match="NaN or infinite"):
        quantize(torch.full((n, k), float("nan")), dense)
    with pytest.raises(Fp8GemvError, match="needs a block mask"):
        pack_weight(w, sparse)
    with pytest.raises(Fp8GemvError, match="block mask must be"):
        pack_weight(w, sparse, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(Fp8GemvError, match="dense spec takes no block mask"):
        pack_weight(w, dense, block_mask(n, k, 0.5))
    codes, scales = quantize(w, dense)
    with pytest.raises(Fp8GemvError, match="codes must be"):
        pack_codes(codes.float(), scales, dense)
    with pytest.raises(Fp8GemvError, match="scales must be"):
        pack_codes(codes, scales[:10], dense)
    with pytest.raises(Fp8GemvError, match="finite"):
        pack_codes(codes, scales * float("inf"), dense)
    packed = pack_codes(codes, scales, dense)
    with pytest.raises(Fp8GemvError, match="block table"):
        check_packed(sparse, packed)
    with pytest.raises(Fp8GemvError, match="dense weight"):
        check_packed(Fp8GemvSpec(n, 2 * k), packed)
    with pytest.raises(Fp8GemvError, match="pass one"):
        check_packed(Fp8GemvSpec(n, k, bias=True), packed)
    with pytest.raises(Fp8GemvError, match="without a bias"):
        check_packed(dense, packed, torch.zeros(n))
    with pytest.raises(Fp8GemvError, match="pass one"):
        fp8_gemv_ref(torch.randn(1, k), packed, Fp8GemvSpec(n, k, bias=True))


def test_split_workspace_ksplit_suggestion_and_bytes():
    spec = Fp8GemvSpec(100, 1000, rows=4, ksplit=3)
    ws = split_buffers(spec, "cpu")
    assert ws["P"].shape == (3, 4, 128) and ws["Cnt"].shape == (4,) and not ws["Cnt"].any()
    assert split_buffers(Fp8GemvSpec(100, 1000), "cpu") == {}
    assert suggest_ksplit(11008, 4096, 132) == 1 and suggest_ksplit(4096, 4096, 132) == 3
    assert suggest_ksplit(64, 64, 132) == 1
    packed = pack_weight(weight(4096, 4096), Fp8GemvSpec(4096, 4096))
    assert bytes_read(Fp8GemvSpec(4096, 4096), packed) == 4096 * 4096 + 4096 * 4 + 2 * 4096 * 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Kernels built through TVM + nvcc: dense bf16 with PDL (the early trigger), one row; block-sparse fp16 bias + SiLU, 4 rows, K split
    over 3 CTAs, no PDL, K % 8 != 0; block scales, 16 rows."""
    pytest.importorskip("tvm")
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from sparta.templates.fp8_gemv.build import build_kernel
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARTA_CACHE", str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("kernels")
    specs = {"f8_one": Fp8GemvSpec(300, 1024, trigger="early", name="f8_one"),
             "f8_split": Fp8GemvSpec(77, 1203, rows=4, dtype="float16", bias=True, act="silu", ksplit=3, warps=2,
                                     sparse=True, pdl=False, name="f8_split"),
             "f8_block": Fp8GemvSpec(130, 512, rows=16, scale="block", inflight=2, name="f8_block"),
             "f8_mma": Fp8GemvSpec(77, 1203, rows=16, dtype="float16", scale="block", bias=True, act="silu",
                                   ksplit=3, warps=2, sparse=True, pdl=False, mma=True, name="f8_mma"),
             "f8_mma_bf16": Fp8GemvSpec(300, 1024, rows=4, trigger="early", mma=True, name="f8_mma_bf16")}
    try:
        yield {name: (spec, build_kernel(spec, out)) for name, spec in specs.items()}
    finally:
        mp.undo()


@needs_build
def test_builds_for_sm89_and_sm90(built):
    for name, (spec, folder) in built.items():
        launch = json.loads((folder / "launch.json").read_text())
        assert sorted(launch["cubins"]) == ["sm_89", "sm_90"] and bool(launch.get("pdl")) == spec.pdl
        assert launch["grid"] == [spec.row_blocks, spec.ksplit, 1] and launch["block"] == [32 * spec.warps, 1, 1]
        args = {a["name"] for a in launch["args"]}
        passed = {"X", "Wp", "S", "Y"} | ({"Tab"} if spec.sparse else set()) | ({"B"} if spec.bias else set()) \
            | set(split_buffers(spec, "cpu"))
        assert args == passed | {"M"}                          # what Fp8GemvOp passes, by name
        src = (folder / "kernel.cu").read_text()
        if spec.mma:                                               # bit-operation decode, MMAs, 8-byte loads
            assert "mma.sync.aligned.m16n8k16" in src and "int2" in src and "cvt.rn.f16x2.e4m3x2" not in src
            assert ("fma.rn.bf16x2" in src) == (spec.dtype == "bfloat16")
        else:
            assert "cvt.rn.f16x2.e4m3x2" in src and "int4" in src  # the decode and 16-byte weight loads
        assert ("griddepcontrol.wait" in src) == spec.pdl and ("atomicAdd" in src) == (spec.ksplit > 1)
        assert (" __restrict__ " in src) != spec.pdl               # no non-coherent loads under PDL
        if spec.pdl:                                               # the trigger before or after the first wait
            body = src[src.index(f"void __launch_bounds__({32 * spec.warps}) {spec.name}_kernel("):]
            early = body.index("sparta_grid_launch_dependents();") < body.index("sparta_grid_wait();")
            assert early == (spec.trigger == "early")
        assert json.loads((folder / "spec.json").read_text())["name"] == name


@needs_build
def test_module_packs_fakes_saves_and_refuses_cpu_inputs(built):
    from sparta.templates.fp8_gemv.runtime import Fp8GemvOp, Fp8LinearCUDA, folder_spec
    spec, folder = built["f8_split"]
    assert folder_spec(folder) == spec
    w, mask = weight(spec.n, spec.k, torch.float16), block_mask(spec.n, spec.k, 0.4)
    bias = torch.randn(spec.n)
    module = Fp8LinearCUDA.from_weight(folder, w, bias, block_mask=mask)
    assert module.spec == spec and module.split_Cnt.shape == (spec.row_blocks,) and not module.split_Cnt.any()
    assert torch.equal(module.dense_weight(), dequantize(pack_weight(w, spec, mask), spec))
    codes, scales = quantize(w, spec, mask)
    again = Fp8LinearCUDA.from_weight(folder, codes, bias, block_mask=mask, scales=scales)
    assert torch.equal(again.codes, module.codes) and torch.equal(again.table, module.table)
    config, tensors, folders = module.saved_state()
    assert sorted(tensors) == ["bias", "codes", "scales", "table"] and list(folders) == ["f8_split"]
    loaded = Fp8LinearCUDA.from_saved(json.loads(json.dumps(config)), tensors, folders)
    assert loaded.spec == spec and torch.equal(loaded.codes, module.codes)
    x = torch.randn(2, 2, spec.k).half()
    rows = x.view(4, spec.k)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        y, = torch.ops.sparta.fp8_gemv(module.kernel_key, [mode.from_tensor(rows)],
                                       [mode.from_tensor(t) for t in module.kernel_weights()])
    assert y.shape == (4, spec.n) and y.dtype == torch.float16
    with pytest.raises(CudaRuntimeError, match="CUDA"):
        module(x)
    with pytest.raises(Fp8GemvError, match="bias"):
        Fp8LinearCUDA.from_weight(folder, w, None, block_mask=mask)
    with pytest.raises(Fp8GemvError, match="need their scales"):
        Fp8LinearCUDA.from_weight(folder, codes, bias, block_mask=mask)
    with pytest.raises(Fp8GemvError, match="quantised here"):
        Fp8LinearCUDA.from_weight(folder, w, bias, block_mask=mask, scales=scales)
    other, other_folder = built["f8_one"]
    with pytest.raises(Fp8GemvError, match="scales must be"):
        Fp8LinearCUDA(folder, spec, pack_weight(weight(other.n, other.k), other), bias)
    op = Fp8GemvOp(other_folder, other, pack_weight(weight(other.n, other.k), other), None)
    with pytest.raises(Fp8GemvError, match="contiguous"):
        op(torch.randn(1, other.k).half())
    with pytest.raises(Fp8GemvError, match="at most"):
        op(torch.randn(2, other.k).bfloat16())
    with pytest.raises(CudaRuntimeError, match="CUDA GPU"):
        op(torch.randn(1, other.k).bfloat16())


@needs_build
def test_build_fp8_gemv_quantises_packs_and_picks_the_split(built, tmp_path):
    pytest.importorskip("tvm")
    from sparta.templates.fp8_gemv.build import build_fp8_gemv
    n, k = 64, 4096
    w, mask = weight(n, k, torch.float16), block_mask(n, k, 0.5)
    module = build_fp8_gemv(w, torch.randn(n), rows=2, block_mask=mask, out=tmp_path, sms=132, inflight=2)
    s = module.spec
    assert s.sparse and s.bias and s.rows == 2 and s.dtype == "float16" and s.ksplit == suggest_ksplit(
        n, k, 132, 4, 2, float(mask.float().mean())) > 1
    assert (tmp_path / s.name / "launch.json").is_file()
    assert torch.equal(module.dense_weight(), dequantize(pack_weight(w, s, mask), s))
    dense = build_fp8_gemv(w, rows=1, block_mask=torch.ones_like(mask), out=tmp_path, name="f8_dense")
    assert not dense.spec.sparse and dense.table is None and dense.spec.ksplit == 1


# The tensor-core kernel (spec.mma): its bit-operation decode and its MMA fragments, emulated lane by lane.
def f8x2_emulated(v: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel.F8_DECODE`` on int64 words ``v`` (bits 8..15 and 24..31 hold two codes): the fp32 values of the low and
    high 16-bit halves, the fp16 decode times 2^8 (folded into the scale) and the bf16 one after its fma by 2^120."""
    shift = 1 if act == "float16" else 4
    r = (v & 0x80008000) | ((v & 0x7F007F00) >> shift)
    halves = [(r & 0xFFFF), (r >> 16) & 0xFFFF]
    if act == "float16":
        return tuple(h.to(torch.int16).view(torch.float16).float() * 256.0 for h in halves)
    return tuple((h << 16).to(torch.int32).view(torch.float32).double() * 2.0 ** 120 for h in halves)


@pytest.mark.parametrize("act", ["float16", "bfloat16"])
def test_mma_decode_is_exact_for_every_code(act):
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F])       # every E4M3 value but NaN
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    for pos in (0, 1, 2, 3):                                                 # the code at each byte of a word
        q = codes.long() << (8 * pos)
        lo_a, hi_a = f8x2_emulated(q << 8 & 0xFFFFFFFF, act)                  # (c0, c2)
        lo_b, hi_b = f8x2_emulated(q, act)                                    # (c1, c3)
        got = [lo_a, lo_b, hi_a, hi_b][pos]
        assert torch.equal(got.double(), want), f"{act} byte {pos}"
        for i, other in enumerate([lo_a, lo_b, hi_a, hi_b]):
            if i != pos:
                assert not other.any()


def emulate_mma(spec: Fp8GemvSpec, packed: Fp8Packed, x: torch.Tensor, bias=None) -> torch.Tensor:
    """The MMA kernel's fragments: lane (g, t) loads words 2t, 2t+1 of block rows g, g+8, 16+g, 24+g; A of row half
    mt and step s = the decoded pairs at k slots (2t, 2t+1) and (2t+8, 2t+9); B = X's columns 8t .. 8t+8 regrouped by
    prmt; C = A B in fp32 (rows g, g+8; X rows 2t, 2t+1); then the fp32 epilogue as the kernel."""
    m = x.shape[0]
    nbr, kb = spec.row_blocks, spec.col_blocks
    xp = torch.zeros(m, kb * BLOCK)
    xp[:, :spec.k] = x.float()
    words = packed.codes.long() & 0xFFFFFFFF
    table = packed.table
    y = torch.zeros(m, nbr * BLOCK, dtype=torch.float64)
    for rb in range(nbr):
        if spec.sparse:
            lo, hi = int(table[rb]), int(table[rb + 1])
            blocks = [(j, int(table[nbr + 1 + j])) for j in range(lo, hi)]
        else:
            blocks = [(rb * kb + c, c) for c in range(kb)]
        for j, c in blocks:
            wb = words[j * 256:(j + 1) * 256].view(BLOCK, 8)                 # row r, word q: columns 4q .. 4q+3
            part = torch.zeros(BLOCK, m, dtype=torch.float64)
            for mt in range(2):
                for s in range(2):
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    b = torch.zeros(16, m, dtype=torch.float64)
                    for g in range(8):
                        for t in range(4):
                            for off in (0, 8):
                                q = wb[mt * 16 + g + off, 2 * t + s]
                                a[g + off, 2 * t], a[g + off, 2 * t + 1] = (v.double() for v in f8x2_emulated(
                                    (q << 8) & 0xFFFFFFFF, spec.dtype))
                                a[g + off, 2 * t + 8], a[g + off, 2 * t + 9] = (v.double() for v in f8x2_emulated(
                                    q, spec.dtype))
                            h = xp[:, c * BLOCK + 8 * t + 4 * s:c * BLOCK + 8 * t + 4 * s + 4].double()  # (m, 4)
                            b[2 * t], b[2 * t + 1], b[2 * t + 8], b[2 * t + 9] = h[:, 0], h[:, 2], h[:, 1], h[:, 3]
                    part[mt * 16:(mt + 1) * 16] += a @ b
            if spec.scale == "block":
                part = part * float(packed.scales[rb * BLOCK // 128, c * BLOCK // 128])
            y[:, rb * BLOCK:(rb + 1) * BLOCK] += part.t()
    y = y[:, :spec.n].float()
    if spec.scale == "channel":
        y = y * packed.scales
    if spec.bias:
        y = y + bias.float()
    return activate(y, spec.act).to(x.dtype)


@pytest.mark.parametrize("n, k, density, knobs", [
    (77, 200, 1.0, dict(rows=3, bias=True, act="gelu")),
    (40, 203, 0.5, dict(rows=16, dtype="float16", scale="block", bias=True, act="silu")),
    (33, 520, 0.3, dict(rows=9, scale="block")),
    (64, 96, 1.0, dict(rows=1, dtype="float16")),
])
def test_mma_fragments_give_the_reference(n, k, density, knobs):
    spec = spec_for(n, k, density, mma=True, **knobs)
    dtype = torch.float16 if spec.dtype == "float16" else torch.bfloat16
    w, mask = weight(n, k, seed=k), block_mask(n, k, density, seed=k)
    w[0, :9] = torch.tensor([0.0, 1e-9, -1e-9, 3e-8, 0.0, -0.0, 5e-7, 0.0, 1.0]).to(dtype)  # zeros, E4M3 subnormals
    bias = (torch.randn(n) * 0.1).to(dtype) if spec.bias else None
    packed = pack_weight(w, spec, mask if spec.sparse else None)
    x = torch.randn(spec.rows, k).to(dtype)
    got = emulate_mma(spec, packed, x, bias).float()
    want = fp8_gemv_ref(x, packed, spec, bias).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
