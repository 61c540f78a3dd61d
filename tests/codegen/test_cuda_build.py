"""Compile-only CUDA builds (no GPU needed): TVM emits CUDA C, nvcc builds cubins, the launch spec is right."""

import json
import shutil

import pytest
import torch

from sparta.codegen.cuda_build import ARCHS, build_cuda
from sparta.templates.bsr_linear.kernel import bsr_linear
from sparta.templates.bsr_linear.packing import block_mask_of, build_table, pack_weight, unpack_weight
from sparta.templates.bsr_linear.spec import BsrSpec, argument_names, reference, reference_int8
from sparta.templates.epilogue_ref import gelu_erf_fast, gelu_tanh_fast, out_scale_arg, requantize
from sparta.templates.quant.spec import quantize_rows

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@needs_nvcc
def test_bsr_template_builds_cubins_for_every_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(200, 96, 72, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="gelu_tanh", name="probe_bsr")
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4",
                  "cp.async.cg.shared.global", "cp.async.wait_group", "uint4"):
        assert instr in src, f"{instr} is emitted"
    launch = json.loads((art.path / "launch.json").read_text())
    assert sorted(launch["cubins"]) == sorted(ARCHS)
    for info in launch["cubins"].values():
        assert (art.path / info["file"]).read_bytes()[:4] == b"\x7fELF"
    shapes = {a["name"]: (a["dtype"], a["shape"]) for a in launch["args"]}
    assert shapes == {"X": ("float16", [200, 72]), "Wp": ("float16", [None]), "B": ("float16", [96]),
                      "Tab": ("int32", [None]), "Y": ("float16", [200, 96])}
    assert launch["grid"][:2] == [-(-200 // 64), 3] and launch["block"][0] == 64
    assert launch["shared_bytes"] == spec.shared_bytes > 0
    again = build_cuda(bsr_linear, spec)
    assert again.cached and again.path == art.path
    (art.path / launch["cubins"]["sm_90"]["file"]).write_bytes(b"corrupt")
    assert not build_cuda(bsr_linear, spec).cached, "a damaged cubin is rebuilt"


@needs_nvcc
def test_gelu_epilogues_use_one_ex2_and_one_rcp(tmp_path, monkeypatch):
    """Both GELUs are built from the SFU's ``ex2.approx`` / ``rcp.approx`` (no ``erff`` / ``tanhf``)."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    for act in ("gelu", "gelu_tanh"):
        art = build_cuda(bsr_linear, BsrSpec(130, 64, 96, bn=32, bk=32, tm=64, warps_m=2, stages=2, act=act,
                                             name=f"probe_{act}"))
        src = (art.path / "kernel.cu").read_text()
        assert "ex2.approx.ftz.f32" in src and "rcp.approx.ftz.f32" in src
        assert "erff(" not in src and "tanhf(" not in src
    x, w = torch.randn(3, 16).half(), torch.randn(8, 16).half()
    torch.testing.assert_close(reference(x, w, None, None, "gelu", 16, 16).float(),
                               torch.nn.functional.gelu(x.float() @ w.float().t()), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_fast_gelu_arithmetic_is_within_6e7_of_the_exact_gelu(act):
    """The kernels' GELU arithmetic (its fp32 twin, the same constants) against float64 GELU on [-12, 12]: absolute
    error below 6e-7 (torch's own fp32 GELUs: 4.5e-7 / 4.3e-7), relative below 2e-4 where |GELU| > 1e-3."""
    x = torch.linspace(-12, 12, 400_001)
    fast = gelu_erf_fast(x) if act == "gelu" else gelu_tanh_fast(x)
    exact = torch.nn.functional.gelu(x.double(), approximate="none" if act == "gelu" else "tanh")
    err = (fast.double() - exact).abs()
    assert err.max() < 6e-7 and (err / exact.abs().clamp_min(1e-3)).max() < 2e-4
    assert fast[x < -11].abs().max() < 1e-20 and torch.equal(fast[x > 11], x[x > 11])


@needs_nvcc
def test_constant_table_is_baked_and_unused_arguments_vanish(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    pattern = ((0, 1), (1, 0), (1, 3), (3, 2))
    spec = BsrSpec(64, 128, 128, bn=32, bk=32, tm=64, warps_m=2, stages=2, bias=False, table="const",
                   pattern=pattern, name="probe_const")
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for r, c in pattern:
        mask[r, c] = True
    values = build_table(mask)[0].tolist()
    assert "__constant__ int" in src and ", ".join(map(str, values)) in src
    assert [a["name"] for a in art.launch["args"]] == ["Wp", "X", "Y"]
    other = BsrSpec(**{**spec.__dict__, "pattern": ((0, 0),)})
    assert build_cuda(bsr_linear, other).path != art.path, "another pattern is another kernel"


def test_table_orders_rows_by_work_and_packs_kept_blocks():
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0], [0, 1, 1]], dtype=torch.bool)
    table, packed = build_table(mask)
    head = table[:12].reshape(4, 3).tolist()
    assert head == [[1, 0, 3], [3, 3, 2], [0, 5, 1], [2, 6, 0]]       # (row, first, count), heaviest first
    assert table[12:].tolist() == [0, 1, 2, 1, 2, 0]
    assert packed == [(1, 0), (1, 1), (1, 2), (3, 1), (3, 2), (0, 0)]
    spec = BsrSpec(4 * 16, 4 * 16, 3 * 16, bn=16, bk=16, tm=64, warps_m=4)
    w = torch.randn(64, 48)
    wp, tab = pack_weight(w, spec, mask)
    assert wp.shape == (6, 16, 16) and torch.equal(tab, table)
    assert torch.equal(wp[3], w[48:64, 16:32].half())


@pytest.mark.parametrize("shape,density", [((70, 45), 0.4), ((64, 48), 0.0), ((64, 48), 1.0)])
def test_unpack_inverts_pack_on_odd_shapes(shape, density):
    spec = BsrSpec(16, shape[0], -(-shape[1] // 8) * 8, bn=16, bk=16, tm=64, warps_m=4)
    w = torch.randn(spec.n, spec.k)
    mask = torch.rand(spec.row_blocks, spec.k_blocks) < density
    wp, tab = pack_weight(w, spec, mask)
    keep = mask.repeat_interleave(16, 0).repeat_interleave(16, 1)[: spec.n, : spec.k]
    assert torch.equal(unpack_weight(wp, tab, spec), (w * keep).half())


def test_block_mask_and_reference_agree_with_dense_math():
    w = torch.randn(40, 24)
    w[:16] = 0                                                         # first block row (bn=16) empty
    mask = block_mask_of(w, 16, 16)
    assert mask.shape == (3, 2) and not mask[0].any() and mask[1:].all()
    x, b = torch.randn(5, 24).half(), torch.randn(40).half()
    y = reference(x, w.half(), mask, b, "relu", 16, 16)
    torch.testing.assert_close(y.float(), torch.relu(x.float() @ w.half().float().t() + b.float()),
                               rtol=1e-3, atol=1e-3)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        BsrSpec(64, 64, 30)
    with pytest.raises(ValueError, match="split into"):
        BsrSpec(64, 64, 64, bn=32, tm=64, warps_m=3)
    with pytest.raises(ValueError, match="activation"):
        BsrSpec(64, 64, 64, act="swish")
    with pytest.raises(ValueError, match="table"):
        BsrSpec(64, 64, 64, table="rom")
    with pytest.raises(ValueError, match="64 x warps_m"):
        BsrSpec(64, 64, 64, bn=64, bk=64, tm=128, warps_m=1, mma="wgmma")
    with pytest.raises(ValueError, match="swizzle atom"):
        BsrSpec(64, 64, 256, bn=64, bk=128, tm=64, warps_m=1, mma="wgmma")
    with pytest.raises(ValueError, match="accumulator registers"):
        BsrSpec(256, 256, 64, bn=256, bk=64, tm=256, warps_m=4, mma="wgmma")
    with pytest.raises(ValueError, match="up to 224"):
        BsrSpec(64, 256, 64, bn=256, bk=64, tm=64, warps_m=1, dtype="int8", mma="wgmma")
    with pytest.raises(ValueError, match="mma"):
        BsrSpec(64, 64, 64, mma="tcgen05")
    with pytest.raises(ValueError, match="producer warpgroup is for mma 'wgmma'"):
        BsrSpec(64, 64, 64, producer=True)
    with pytest.raises(ValueError, match="persistent grid"):
        BsrSpec(64, 64, 64, bn=32, bk=32, tm=64, warps_m=1, mma="wgmma", ctas=4)
    pp = dict(bn=128, bk=64, tm=128, warps_m=2, dtype="int8", mma="wgmma", producer=True)
    with pytest.raises(ValueError, match="pingpong: for a persistent producer kernel"):
        BsrSpec(256, 256, 256, pingpong=True, **pp)               # not persistent
    with pytest.raises(ValueError, match="pingpong: for a persistent producer kernel"):
        BsrSpec(256, 256, 256, **{**pp, "tm": 256, "warps_m": 4}, ctas=2, pingpong=True)
    with pytest.raises(ValueError, match="exceed the 232448 a Hopper CTA can have"):
        BsrSpec(256, 256, 256, stages=10, ctas=2, pingpong=True, **pp)   # fp16 out tiles beside 10 stages


@needs_nvcc
@pytest.mark.parametrize("kw,pairs", [(dict(), 32), (dict(dtype="int8", out="int8"), 32),
                                      (dict(mma="wgmma", bk=64), 32), (dict(mma="wgmma", dtype="int8"), 32)])
def test_epilogue_reads_column_constants_once_per_tile(tmp_path, monkeypatch, kw, pairs):
    """Bias and weight scales are loaded once per CTA into shared memory (fp32, a float4 per column pair), not per
    output element; two outputs leave per shared store (half2, or two int8 codes)."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    base = dict(bn=64, bk=32, tm=128, warps_m=2, stages=3, act="gelu")
    spec = BsrSpec(257, 192, 320, name="probe_epi", **{**base, **kw})
    assert spec.shared_bytes % 16 == 0 and spec.shared_bytes >= max(
        spec.stages * (spec.tm * spec.bk // spec.elems_per_half + spec.w_lanes), spec.out_lanes) * 2 + pairs * 16
    src = (build_cuda(bsr_linear, spec).path / "kernel.cu").read_text()
    body = src[src.index("__global__"):]
    assert body.count("B_ptr[") == 2 and "sparta_st_f32x4(" in body and "sparta_ld_f32x4(" in body
    if spec.dtype == "int8":
        assert body.count("WS_ptr[") == 2
    assert ("sparta_st_s8x2(" if spec.out == "int8" else "sparta_st_h2(") in body
    assert body.count("__syncthreads()") <= 3, "no barrier between the constant reads and the tile's writes"


@needs_nvcc
def test_warp_specialised_wgmma_kernel_builds(tmp_path, monkeypatch):
    """A producer warpgroup loads, the consumers wait on mbarriers; the persistent grid has ``ctas`` CTAs and
    shared memory for the stages, the output tile, two constant buffers and the barrier rings."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(257, 192, 320, bn=64, bk=128, tm=128, warps_m=2, stages=4, act="gelu", dtype="int8",
                   out="int8", mma="wgmma", producer=True, ctas=2, name="probe_ws")
    stage = spec.tm * spec.bk // 2 + spec.w_lanes
    assert spec.threads == 384 and spec.shared_bytes == -(-(4 * stage + spec.out_lanes) * 2 // 16) * 16 + \
        2 * 64 * 8 + 16 * 4
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    for needle in ("mbarrier.init.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
                   "mbarrier.arrive.shared::cta.b64", "fence.mbarrier_init.release.cluster", "bar.sync %0, %1",
                   "cp.async.mbarrier.arrive.noinc.shared::cta.b64", "fence.proxy.async.shared::cta",
                   "wgmma.mma_async.sync.aligned.m64n64k32"):
        assert needle in src, f"{needle} is emitted"
    assert art.launch["grid"] == [2, 1, 1] and art.launch["block"] == [384, 1, 1]
    assert art.launch["shared_bytes"] == spec.shared_bytes
    from sparta.codegen.build import _relative_imports
    from sparta.templates.bsr_linear import kernel
    assert {"sparta.templates.bsr_linear.warp_specialized", "sparta.templates.bsr_linear.wgmma"} <= \
        _relative_imports(kernel.__name__), "editing the variants changes the cache key"


@needs_nvcc
def test_pingpong_kernel_builds(tmp_path, monkeypatch):
    """Two consumer warpgroups take alternate tiles (both 64-row halves each): 384 threads, an output tile and two
    constant buffers per role, two turn barriers after the rings; each role syncs on its own named barrier and
    issues the wgmmas of both halves; no accumulator spills."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(300, 256, 320, bn=128, bk=64, tm=128, warps_m=2, stages=6, act="relu", dtype="int8",
                   out="int8", mma="wgmma", producer=True, ctas=3, pingpong=True, name="probe_pp")
    stage = spec.tm * spec.bk // 2 + spec.w_lanes
    assert spec.threads == 384 and spec.roles == 2
    assert spec.const_offset == -(-(6 * stage + 2 * spec.out_lanes) * 2 // 16) * 16
    assert spec.shared_bytes == spec.const_offset + 4 * 128 * 8 + 16 * 6 + 16
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    body = src[src.index("probe_pp_kernel("):]
    assert "uint acc2_ptr[64]" in body and "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in src
    assert body.count("sparta_named_sync((((int)threadIdx.x) >> 7), 128)") == 2, "a named barrier per role (1, 2)"
    assert art.launch["grid"] == [3, 1, 1] and art.launch["block"] == [384, 1, 1]
    assert art.launch["shared_bytes"] == spec.shared_bytes
    assert BsrSpec(**{**spec.__dict__, "pingpong": False}).key() != spec.key()
    # 128 accumulator registers per consumer thread: registers move from the producer (setmaxnreg); 32 do not
    assert "setmaxnreg.dec.sync.aligned.u32 40" in src and "setmaxnreg.inc.sync.aligned.u32 232" in src
    narrow = BsrSpec(**{**spec.__dict__, "bn": 64, "tm": 64, "warps_m": 1, "name": "probe_pp64"})
    assert "setmaxnreg" not in (build_cuda(bsr_linear, narrow).path / "kernel.cu").read_text()


@needs_nvcc
@pytest.mark.parametrize("dtype,bk,instr", [("float16", 64, "m64n64k16.f32.f16.f16"),
                                            ("float16", 16, "m64n64k16.f32.f16.f16"),
                                            ("int8", 64, "m64n64k32.s32.s8.s8")])
def test_wgmma_kernel_builds_for_sm90a_only(tmp_path, monkeypatch, dtype, bk, instr):
    """The Hopper variant: wgmma from shared-memory descriptors (swizzle mode from the row width),
    async-proxy fence after the cp.async copies, one warpgroup per 64 rows, an sm_90a cubin only."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(257, 192, 320, bn=64, bk=bk, tm=128, warps_m=2, stages=4, act="gelu", dtype=dtype,
                   mma="wgmma", name="probe_wg")
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    for needle in (f"wgmma.mma_async.sync.aligned.{instr}", "wgmma.fence.sync.aligned", "wgmma.commit_group",
                   "wgmma.wait_group.sync.aligned 1", "fence.proxy.async.shared::cta", "cp.async.cg.shared.global"):
        assert needle in src, f"{needle} is emitted"
    assert "ldmatrix" not in src and "mma.sync" not in src
    row_bytes = bk * (1 if dtype == "int8" else 2)
    swizzle = {32: 1, 64: 2, 128: 3}[row_bytes]
    assert f"ptx_wgmma_encode_matrix_descriptor((&(desc_ptr[0])), (&(smem_ptr[0])), 1, {row_bytes // 2}, {swizzle})" \
        in src, "one descriptor: 8-row groups of the swizzled rows apart, the swizzle of the row width"
    assert sorted(art.launch["cubins"]) == ["sm_90a"] and spec.archs == ("sm_90a",)
    assert art.launch["block"][0] == 256 == spec.threads and art.launch["grid"][:2] == [3, 3]
    assert (art.path / "kernel.sm_90a.cubin").read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
def test_w8a8_kernel_builds_with_int_mma_and_scale_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(200, 100, 80, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="relu", dtype="int8", name="probe_i8")
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in src and "m16n8k16" not in src
    args = {a["name"]: a for a in art.launch["args"]}
    assert set(args) == set(argument_names(spec)) == {"X", "XS", "Wp", "WS", "B", "Tab", "Y"}
    assert args["X"]["shape"] == [200, 40] and args["X"]["dtype"] == "float16"    # int8 pairs as 16-bit lanes
    assert all((art.path / c["file"]).stat().st_size > 0 for c in art.launch["cubins"].values())
    fp16 = build_cuda(bsr_linear, BsrSpec(200, 100, 80, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="relu",
                                          name="probe_f16"))
    assert "XS" not in {a["name"] for a in fp16.launch["args"]}


@needs_nvcc
@pytest.mark.parametrize("kw", [dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3),
                                dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3, groups=2),
                                dict(bn=192, bk=128, tm=128, warps_m=2, stages=4, mma="wgmma")])
def test_requantizing_epilogue_builds_int8_output(tmp_path, monkeypatch, kw):
    """``out="int8"``: Y is int8, an ``OS`` [scale, 1/scale] argument appears, the fp32 value times RN(1/scale)/254
    plus ½ is saturated to [0, 1] and the code is the low byte of its fma by 254 plus 1.5·2²³ − 127 (rounded half
    to even by that fma; no float→int conversion, no clamp), and the tile leaves in 16-byte rows (N % 16 == 0); the fp16-output kernel of the same spec has neither."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(257, 384, 320, act="gelu", dtype="int8", out="int8", name="probe_q8", **kw)
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    args = {a["name"]: (a["dtype"], a["shape"]) for a in art.launch["args"]}
    assert set(args) == set(argument_names(spec)) and "OS" in args
    assert args["Y"] == ("int8", [257, 384]) and args["OS"] == ("float32", [2])
    assert "__saturatef(__fmaf_rn(" in src and "(OS_ptr[1] * 0x1.0204081020408p-8f" in src
    assert "0x1.fcp+7f/*2.540000e+02*/, 0x1.7fff02p+23f" in src
    assert "__float2int_rn" not in src and "nearbyintf" not in src
    assert "*(int4*)(Y_ptr" in src
    assert art.launch["shared_bytes"] == spec.shared_bytes
    fp16 = BsrSpec(257, 384, 320, act="gelu", dtype="int8", name="probe_f16out", **kw)
    assert "out" not in fp16.key() and spec.key()["out"] == "int8"
    assert spec.out_lanes == spec.tm * (spec.bn + 16) // 2 and fp16.out_lanes == spec.tm * (spec.bn + 8)
    with pytest.raises(ValueError, match="out"):
        BsrSpec(64, 64, 64, out="int4")


@needs_nvcc
@pytest.mark.parametrize("kw", [dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=2, groups=3, act="relu"),
                                dict(bn=192, bk=128, tm=128, warps_m=2, stages=4, mma="wgmma"),
                                dict(bn=32, bk=32, tm=64, warps_m=2, stages=3, dtype="float16")])
def test_int8_output_folds_the_reciprocal_scale_into_the_column_constants(tmp_path, monkeypatch, kw):
    """Without an activation, or with ReLU, RN(1/scale)/span multiplies the staged weight scales and bias once per
    column instead of every output: an output is one saturated fma of the staged constants (ReLU: codes 0..127,
    span 127), then the fma that rounds it to a code; with GELU the scale is applied per output."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(257, 384, 320, out="int8", name="probe_fold", **{"dtype": "int8", **kw})
    src = (build_cuda(bsr_linear, spec).path / "kernel.cu").read_text()
    span = "0x1.fcp+6f" if kw.get("act") == "relu" else "0x1.fcp+7f"
    assert "__saturatef(__fmaf_rn(" in src and "kc_ptr[2]));" in src and f"__fmaf_rn(yv_ptr[0], {span}" in src
    assert "OS_ptr[1] * " in src and "__fadd_rn" not in src and "__fmul_rn" not in src
    gelu = BsrSpec(257, 384, 320, out="int8", name="probe_fold", **{"dtype": "int8", **kw, "act": "gelu_tanh"})
    src = (build_cuda(bsr_linear, gelu).path / "kernel.cu").read_text()
    assert "(OS_ptr[1] * 0x1.0204081020408p-8f" in src and "0x1p-1f" in src


def test_requantize_reference_rounds_half_to_even_and_clamps():
    y = torch.tensor([[0.25, 0.75, -0.25, 1000.0, -1000.0, 0.0]])
    assert requantize(y, 0.5).tolist() == [[0, 2, 0, 127, -127, 0]]
    os_arg = out_scale_arg(0.1)
    assert os_arg.dtype == torch.float32 and os_arg[1] == 1 / torch.tensor(0.1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            out_scale_arg(bad)
    x, w = torch.randn(5, 32), torch.randn(16, 32)
    fp = reference(x.half(), w.half(), None, None, "relu", 16, 16)
    codes = reference(x.half(), w.half(), None, None, "relu", 16, 16, out_scale=0.05)
    assert codes.dtype == torch.int8 and (codes.float() * 0.05 - fp.float().clamp(max=127 * 0.05)).abs().max() < 0.03


def test_w8a8_pack_and_reference():
    g = torch.Generator().manual_seed(0)
    spec = BsrSpec(33, 70, 96, bn=32, bk=32, tm=64, warps_m=2, dtype="int8")
    w, x = torch.randn(70, 96, generator=g), torch.randn(33, 96, generator=g)
    mask = torch.rand(spec.row_blocks, spec.k_blocks, generator=g) < 0.5
    wq, ws = quantize_rows(w)
    wp, tab = pack_weight(wq, spec, mask)
    keep = mask.repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :96]
    assert wp.dtype == torch.int8 and torch.equal(unpack_weight(wp, tab, spec), wq * keep)
    xq, xs = quantize_rows(x)
    y = reference_int8(xq, xs, wq, ws, mask, None, "none", 32, 32).float()
    exact = x @ (w * keep).t()
    sqnr = 10 * torch.log10(exact.pow(2).mean() / (y - exact).pow(2).mean())
    assert sqnr > 30
    with pytest.raises(ValueError, match="int8"):
        BsrSpec(64, 64, 72, dtype="int8")


@needs_nvcc
def test_row_quantizer_builds_with_vector_loads_and_half_even_rounding(tmp_path, monkeypatch):
    from sparta.templates.quant.kernel import quantize_rows_kernel
    from sparta.templates.quant.spec import QuantRowsSpec
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    art = build_cuda(quantize_rows_kernel, QuantRowsSpec(37, 200, threads=32, name="probe_q"))
    src = (art.path / "kernel.cu").read_text()
    assert "*(uint4*)" in src and "nearbyintf" in src          # 16-byte loads; round half to even like torch
    assert "shfl.sync.bfly" in src and "__syncthreads" not in src   # a warp per row: shuffles only
    assert art.launch["grid"][0] == 10 and art.launch["block"][0] == 128    # four rows per CTA
    assert {a["name"] for a in art.launch["args"]} == {"X", "XQ", "XS"}
    cta = build_cuda(quantize_rows_kernel, QuantRowsSpec(37, 1000, threads=128, name="probe_q_cta"))
    assert cta.launch["grid"][0] == 37 and "__syncthreads" in (cta.path / "kernel.cu").read_text()
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantRowsSpec(4, 12)
    with pytest.raises(ValueError, match="more threads"):
        QuantRowsSpec(4, 8200)


def test_cache_key_covers_the_modules_a_template_imports():
    from sparta.codegen.build import _relative_imports, _source_digest
    from sparta.templates.bsr_linear import kernel as bsr
    from sparta.templates.w4a16_gemv import kernel as w4a16
    # the W4A16 block stage and the shared dequantisation macro live in other modules than the template:
    # editing them must change the key of every kernel built with them
    assert {"sparta.templates.bsr_linear.warp_mma", "sparta.templates.ptx"} <= _relative_imports(bsr.__name__)
    assert _relative_imports(w4a16.__name__) == {w4a16.__name__, "sparta.templates.w4a16_gemv.spec",
                                                 "sparta.templates.ptx"}
    assert _source_digest(bsr) != _source_digest(w4a16)


@needs_nvcc
def test_programmatic_dependent_launch_loads_weights_before_the_wait(tmp_path, monkeypatch):
    """``pdl``: the prologue's weight blocks load before ``griddepcontrol.wait``; X, the row scales and every store
    after it, and the trigger for the next kernel right after the wait. launch.json asks the runtime for the
    attribute; the PTX is guarded to sm_90, so the sm_80 cubin still builds. Only the one-tile mma.sync kernel."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    kw = dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3, act="relu", dtype="int8", out="int8")
    art = build_cuda(bsr_linear, BsrSpec(257, 192, 320, pdl="late", name="probe_bsr_pdl", **kw))
    src = (art.path / "kernel.cu").read_text()
    body = src[src.index('extern "C" __global__'):]
    body = body[body.index("{"):]
    wait, trigger = body.index("sparta_grid_wait();"), body.index("sparta_grid_launch_dependents();")
    assert body.index("Wp_ptr[") < wait < trigger < body.index("X_ptr[") and wait < body.index("XS_ptr[")
    assert wait < body.index("Y_ptr") and "__CUDA_ARCH__ >= 900" in src
    assert art.launch["pdl"] is True and sorted(art.launch["cubins"]) == ["sm_80", "sm_90"]
    plain = BsrSpec(257, 192, 320, name="probe_bsr", **kw)
    assert "pdl" not in build_cuda(bsr_linear, plain).launch and "pdl" not in plain.key()
    tail = (build_cuda(bsr_linear, BsrSpec(257, 192, 320, pdl="tail", name="probe_bsr_pdlt", **kw)).path
            / "kernel.cu").read_text()
    tail = tail[tail.index('extern "C" __global__'):]
    assert tail.index("sparta_grid_wait();") < tail.index("mma_int_sync") < tail.index("launch_dependents();")
    for bad in (dict(mma="wgmma", warps_n=1), dict(groups=2), dict(pdl="early"), dict(dtype="w4a16", out="float16")):
        with pytest.raises(ValueError, match="pdl"):
            BsrSpec(257, 192, 320, **{"pdl": "late", **kw, **bad})
