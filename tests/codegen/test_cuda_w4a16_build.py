"""W4A16 (int4 weights, fp16 activations): packing on the CPU, and compile-only CUDA builds (no GPU)."""

import json
import shutil

import numpy as np
import pytest
import torch

from sparta.codegen.cuda_build import ARCHS, build_cuda
from sparta.templates.w4a16_gemv.kernel import w4a16_gemv
from sparta.templates.w4a16_gemv.spec import (ORDER, W4A16Spec, argument_names, codes_of, dequantize, pack_codes,
                                              pack_weight, quantize, reference, split_buffers, unpack)

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _random(n, k, group, sym, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).half()
    zero = None if sym else torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    return q, scale, zero


@pytest.mark.parametrize("n,k,group,sym", [(333, 1024, 128, True), (203, 544, 32, False), (7, 64, 64, False),
                                           (1, 32, 32, True), (517, 2048, 128, False)])
def test_pack_unpack_round_trip_on_odd_shapes(n, k, group, sym):
    spec = W4A16Spec(3, n, k, group=group, sym=sym)
    q, scale, zero = _random(n, k, group, sym, seed=n * 7 + k)
    wq, s, z = pack_codes(q, scale, zero, spec)
    assert wq.dtype == torch.int32 and tuple(wq.shape) == (spec.tiles, spec.chunks, 32, 4)
    assert tuple(s.shape) == (spec.tiles, spec.groups, 8) and (z is None) == sym
    q2, s2, z2 = unpack(wq, s, z, spec)
    assert torch.equal(q2, q) and torch.equal(s2, scale)
    assert sym or torch.equal(z2, zero)


def test_layout_puts_lane_k_ranges_where_the_kernel_reads_them():
    spec = W4A16Spec(1, 16, 256, group=32)
    q = torch.arange(16 * 256).reshape(16, 256) % 16
    wq = pack_codes(q.to(torch.uint8), torch.ones(16, 8).half(), None, spec)[0]
    words = wq.to(torch.int64) & 0xFFFFFFFF
    tile, chunk, lane, word, e = 1, 1, 4 * 5 + 2, 3, 6                     # row 8+5, K = 128 + 64 + 24 + 6
    assert int((words[tile, chunk, lane, word] >> (4 * ORDER[e])) & 0xF) == int(q[13, 128 + 64 + 24 + e])


def test_magic_number_dequant_matches_dequantize():
    """Emulate the kernel's lop3 | 0x64006400, sub/fma, mul on the packed words (numpy fp16)."""
    spec = W4A16Spec(1, 24, 256, group=64, sym=False)
    q, scale, zero = _random(24, 256, 64, False, seed=3)
    wq, s, z = pack_codes(q, scale, zero, spec)
    w = (wq.numpy().astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)          # tile, chunk, lane, word
    halves = lambda u: u.astype(np.uint32).view(np.float16).reshape(*u.shape, 2)   # noqa: E731
    lo = halves((w & 0x000F000F) | 0x64006400)
    hi = halves((w & 0x00F000F0) | 0x64006400)
    lo2 = halves(((w >> 8) & 0x000F000F) | 0x64006400)
    hi2 = halves(((w >> 8) & 0x00F000F0) | 0x64006400)
    kb = (np.arange(spec.chunks)[:, None, None] * 128 + (np.arange(32) % 4)[None, :, None] * 32)[None]   # 1,chunk,lane,1
    grp = kb // 64
    zz = z.numpy()[np.arange(spec.tiles)[:, None, None, None], grp, (np.arange(32) // 4)[None, None, :, None]]
    ss = s.numpy()[np.arange(spec.tiles)[:, None, None, None], grp, (np.arange(32) // 4)[None, None, :, None]]
    zz, ss = zz[..., None].astype(np.float16), ss[..., None]
    pairs = [(lo - (np.float16(1024) + zz)) * ss, (hi * np.float16(1 / 16) - (np.float16(64) + zz)) * ss,
             (lo2 - (np.float16(1024) + zz)) * ss, (hi2 * np.float16(1 / 16) - (np.float16(64) + zz)) * ss]
    vals = np.stack(pairs, -2).reshape(*w.shape, 8)                          # elements 0..7 of each word
    dense = torch.from_numpy(vals.astype(np.float32)).reshape(spec.tiles, spec.chunks, 8, 4, 4, 8)
    dense = dense.permute(0, 2, 1, 3, 4, 5).reshape(spec.tiles * 8, spec.chunks * 128)[:24, :256]
    torch.testing.assert_close(dense, dequantize(wq, s, z, spec), rtol=1e-3, atol=0)


@pytest.mark.parametrize("sym", [True, False])
def test_quantize_and_reference_agree_with_dense_math(sym):
    g = torch.Generator().manual_seed(11)
    w, x = torch.randn(70, 256, generator=g), torch.randn(5, 256, generator=g).half()
    bias = torch.randn(70, generator=g).half()
    spec = W4A16Spec(5, 70, 256, group=32, sym=sym, bias=True)
    scale, zero = quantize(w, 32, sym)
    q = codes_of(w, scale, zero, 32)
    assert int(q.max()) <= 15 and (q.float().std() > 2)
    wq, s, z = pack_weight(w, scale, zero, spec)
    y = reference(x, wq, s, z, bias, spec)
    exact = x.float() @ w.t() + bias.float()
    sqnr = 10 * torch.log10(exact.pow(2).mean() / (y - exact).pow(2).mean())
    assert sqnr > 15, f"int4 round-to-nearest SQNR {sqnr:.1f} dB"


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="1..16"):
        W4A16Spec(17, 64, 128)
    with pytest.raises(ValueError, match="multiple of the group"):
        W4A16Spec(1, 64, 96, group=64)
    with pytest.raises(ValueError, match="group"):
        W4A16Spec(1, 64, 96, group=16)
    with pytest.raises(ValueError, match="acc"):
        W4A16Spec(1, 64, 128, acc="bfloat16")
    with pytest.raises(ValueError, match="fold"):
        W4A16Spec(1, 64, 128, group=64, fold=True)
    with pytest.raises(ValueError, match="fold"):
        W4A16Spec(1, 64, 128, acc="float16", fold=True)
    with pytest.raises(ValueError, match="min_ctas"):
        W4A16Spec(1, 64, 128, warps=16, min_ctas=5)         # 80 warps do not fit on an SM
    with pytest.raises(ValueError, match="ksplit"):
        W4A16Spec(1, 64, 384, ksplit=4)                     # 3 chunks of 128 cannot split 4 ways
    with pytest.raises(ValueError, match="shared memory"):
        W4A16Spec(16, 64, 128, ntile=16, warps=8)


def test_split_k_workspace_matches_the_kernel_arguments():
    spec = W4A16Spec(16, 517, 2048, ntile=8, warps=4, ksplit=4)
    bufs = split_buffers(spec, "cpu")
    assert set(bufs) == {"P", "C"} and set(bufs) < set(argument_names(spec))
    assert tuple(bufs["P"].shape) == (4, 16, spec.grid * 64) and bufs["P"].dtype == torch.float32
    assert tuple(bufs["C"].shape) == (spec.grid,) and not bufs["C"].any()
    assert split_buffers(W4A16Spec(16, 517, 2048), "cpu") == {}


@needs_nvcc
@pytest.mark.parametrize("spec", [W4A16Spec(5, 203, 544, group=32, sym=False, bias=True, name="probe_w4_asym"),
                                  W4A16Spec(16, 100, 800, group=32, ntile=3, warps=2, unroll=3, name="probe_w4_m16"),
                                  W4A16Spec(1, 333, 4096, acc="float16", name="probe_w4_f16acc"),
                                  W4A16Spec(9, 61, 640, sym=False, ntile=3, warps=2, fold=True, name="probe_w4_fold"),
                                  W4A16Spec(5, 203, 1632, group=32, warps=2, ksplit=3, name="probe_w4_ks3")])
def test_w4a16_kernel_builds_with_lop3_dequant_and_mma(tmp_path, monkeypatch, spec):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    art = build_cuda(w4a16_gemv, spec)
    src = (art.path / "kernel.cu").read_text()
    mma = "m16n8k16.row.col.f16.f16.f16.f16" if spec.acc == "float16" else "m16n8k16.row.col.f32.f16.f16.f32"
    for instr in ("lop3.b32", "0x64006400" if "0x64006400" in src else "1677747200", "sub.f16x2",
                  "fma.rn.f16x2", mma, "ld.global.nc.L1::no_allocate.v4.b32", "uint4"):
        assert instr in src, f"{instr} is emitted"
    assert ("mul.f16x2" in src) != spec.fold, "the scale is folded into the fp32 sum instead of each weight"
    launch = json.loads((art.path / "launch.json").read_text())
    assert sorted(launch["cubins"]) == sorted(ARCHS)
    assert all((art.path / c["file"]).read_bytes()[:4] == b"\x7fELF" for c in launch["cubins"].values())
    args = {a["name"]: a for a in launch["args"]}
    assert set(args) == set(argument_names(spec))
    assert args["Wq"]["shape"] == [spec.tiles, spec.chunks, 32, 4] and args["X"]["shape"] == [spec.m, spec.k]
    assert launch["grid"][:2] == [-(-spec.tiles // spec.ntile), spec.ksplit] and launch["block"][0] == 32 * spec.warps
    assert ("atomicAdd" in src) == (spec.ksplit > 1), "split K counts arrivals; one CTA per row block does not"


@needs_nvcc
def test_min_ctas_bounds_the_registers_through_launch_bounds(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = W4A16Spec(1, 333, 1152, sym=False, bias=True, fold=True, warps=8, min_ctas=6, name="probe_w4_bounded")
    art = build_cuda(w4a16_gemv, spec)
    assert "__launch_bounds__(256, 6)" in (art.path / "kernel.cu").read_text()
    assert art.launch["block"][0] == 256 and {a["name"] for a in art.launch["args"]} == set(argument_names(spec))
    assert "min_ctas" in spec.key() and "min_ctas" not in W4A16Spec(1, 333, 1152).key()   # old keys unchanged


@needs_nvcc
@pytest.mark.parametrize("pdl", ["early", "late"])
def test_programmatic_dependent_launch_waits_before_reading_x(tmp_path, monkeypatch, pdl):
    """``pdl``: the first chunk's weights and scales load before ``griddepcontrol.wait``, X only after it (and every
    store after the loads); the trigger for the next kernel before the loop ("early") or right after the wait
    ("late"); launch.json asks the runtime for the attribute. Guarded to sm_90, so the sm_80 cubin still builds."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = W4A16Spec(3, 200, 640, group=64, sym=False, bias=True, warps=2, ksplit=2, pdl=pdl, name="probe_pdl")
    art = build_cuda(w4a16_gemv, spec)
    src = (art.path / "kernel.cu").read_text()
    body = src[src.index("extern \"C\" __global__"):]
    body = body[body.index("{"):]                  # past the parameter list
    wait, trigger = body.index("sparta_grid_wait();"), body.index("sparta_grid_launch_dependents();")
    assert body.index("ld_vec_global_nc") < wait < body.index("X_ptr") and wait < body.index("Y_ptr[")
    assert (trigger < body.index("ld_vec_global_nc")) if pdl == "early" else (wait < trigger < body.index("X_ptr"))
    assert "__CUDA_ARCH__ >= 900" in src and art.launch["pdl"] is True and sorted(art.launch["cubins"]) == ["sm_80", "sm_90"]
    assert "pdl" not in build_cuda(w4a16_gemv, W4A16Spec(3, 200, 640, group=64, name="probe_nopdl")).launch
    assert "pdl" not in W4A16Spec(1, 333, 1152).key()
    with pytest.raises(ValueError, match="pdl"):
        W4A16Spec(1, 64, 128, pdl="yes")


def test_compile_picks_the_measured_gemv_tilings():
    from sparta.templates.w4a16_gemv.select import gemv_tiling
    early = dict(pdl="early")
    assert gemv_tiling(1, 11008, 4096, 128) == dict(ntile=4, warps=8, unroll=1, min_ctas=3, fold=False, **early)
    assert gemv_tiling(1, 4096, 11008, 128) == dict(ntile=2, warps=16, unroll=1, min_ctas=2, fold=True, **early)
    assert gemv_tiling(1, 4096, 4096, 128) == dict(ntile=2, warps=16, unroll=1, fold=True, **early)
    late = dict(pdl="late")
    assert gemv_tiling(16, 1024, 2048, 64) == dict(ntile=4, warps=8, unroll=1, ksplit=2, fold=False, **late)
    assert gemv_tiling(12, 4096, 4096, 128) == dict(ntile=4, warps=8, unroll=1, fold=False, **late)
    assert gemv_tiling(16, 11008, 4096, 128) == dict(ntile=4, warps=8, unroll=1, min_ctas=3, fold=False, **late)
    for m, n, k, g in [(1, 11008, 4096, 128), (8, 4096, 11008, 128), (16, 1024, 2048, 64), (3, 300, 640, 32)]:
        W4A16Spec(m, n, k, group=g, **gemv_tiling(m, n, k, g))          # every pick is a valid spec
