"""The FP8 dequantisation kernel (``templates/fp8_gemv/dequant.py``) without a GPU: its spec and checks, the spec of
a GEMV's packed weight, the torch reference (code × scale rounded once, zeros at pruned blocks; a hypothesis property
over shapes, densities, scales and types), and the kernel built through TVM + nvcc (16-byte loads and stores, the
arguments the launcher passes)."""

import json
import math
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparta.runtime.cuda import CudaRuntimeError
from sparta.templates.fp8_gemv.dequant import Fp8DequantOp, Fp8DequantSpec, dequant_ref, fp8_dequant
from sparta.templates.fp8_gemv.spec import (BLOCK, DTYPES, Fp8GemvError, Fp8GemvSpec, element_mask, expand_scales,
                                            pack_codes, pack_weight, quantize)

from fixtures.fp8_data import block_mask, weight

needs_build = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@pytest.mark.parametrize("kw, words", [(dict(n=0, k=64), "positive"), (dict(n=8, k=-1), "positive"),
                                       (dict(n=8, k=64, dtype="float32"), "dtype"),
                                       (dict(n=8, k=64, scale="tensor"), "scale"),
                                       (dict(n=8, k=64, cols=3), "cols=3")])
def test_bad_specs_are_refused_with_the_reason(kw, words):
    with pytest.raises(Fp8GemvError, match=words):
        Fp8DequantSpec(**kw)


@pytest.mark.parametrize("gemv, name", [
    (Fp8GemvSpec(333, 1031, rows=16, dtype="float16", sparse=True, scale="block", warps=2, ksplit=3),
     "fp8_dequant_333x1031_sparse_block"),
    (Fp8GemvSpec(4096, 4096, mma=True, pdl=False), "fp8_dequant_4096x4096_bf16")])
def test_the_spec_for_a_gemv_reads_its_packed_weight(gemv, name):
    spec = Fp8DequantSpec.for_gemv(gemv)
    assert (spec.n, spec.k, spec.dtype, spec.sparse, spec.scale) == (gemv.n, gemv.k, gemv.dtype, gemv.sparse,
                                                                     gemv.scale)
    assert spec.name == name and Fp8DequantSpec(**spec.key()) == spec
    g = spec.gemv
    assert (g.row_blocks, g.col_blocks, g.scale_shape) == (gemv.row_blocks, gemv.col_blocks, gemv.scale_shape)
    assert (spec.row_blocks, spec.col_blocks) == (gemv.row_blocks, gemv.col_blocks)


def test_the_family_builds_the_spec_with_this_template():
    from sparta.codegen.cuda_build import cuda_templates
    assert cuda_templates()[Fp8DequantSpec] is fp8_dequant


def _check_reference(n, k, density, sparse, block, dtype, seed):
    gemv = Fp8GemvSpec(n, k, dtype="float16" if dtype == torch.float16 else "bfloat16", sparse=sparse,
                       scale="block" if block else "channel")
    spec = Fp8DequantSpec.for_gemv(gemv)
    w, mask = weight(n, k, dtype, seed), block_mask(n, k, density, seed)
    bm = mask if sparse else None
    codes, scales = quantize(w, gemv, bm)
    packed = pack_codes(codes, scales, gemv, bm)
    got = dequant_ref(packed, spec)
    keep = element_mask(mask if sparse else torch.ones_like(mask), n, k)
    want = torch.where(keep, codes.float() * expand_scales(scales, gemv), torch.zeros(())).to(dtype)
    assert got.shape == (n, k) and got.dtype == dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "bit for bit"
    assert not got[~keep].view(torch.int16).any(), "+0 at pruned blocks"
    assert bool(got[keep].ne(0).all()), "random weights: no kept zero"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 100), k=st.integers(1, 300), density=st.floats(0, 1), sparse=st.booleans(),
       block=st.booleans(), fp16=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_reference_is_the_codes_times_scales_rounded_once_with_zeros_where_pruned(n, k, density, sparse, block, fp16,
                                                                                  seed):
    _check_reference(n, k, density if sparse else 1.0, sparse, block, torch.float16 if fp16 else torch.bfloat16, seed)


@pytest.mark.parametrize("density", [0.0, 1.0])
@pytest.mark.parametrize("n, k", [(77, 200), (65, 203), (130, 257)])
def test_reference_with_no_block_kept_and_every_block_kept(n, k, density):
    for block in (False, True):
        _check_reference(n, k, density, True, block, torch.bfloat16, n + k)
    dense = dequant_ref(pack_weight(weight(n, k), Fp8GemvSpec(n, k)), Fp8DequantSpec(n, k))
    full = dequant_ref(pack_weight(weight(n, k), Fp8GemvSpec(n, k, sparse=True), block_mask(n, k, 1.0)),
                       Fp8DequantSpec(n, k, sparse=True))
    assert torch.equal(dense, full)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Kernels built through TVM + nvcc: block-sparse with block scales (bf16), dense fp16 with K % 8 != 0, dense bf16
    with K % 32 != 0 in tiles of 16 block columns (four pieces a thread), and of 2 (two warps a CTA) with 8-byte
    stores (K % 8 == 4)."""
    pytest.importorskip("tvm")
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from sparta.templates.fp8_gemv.dequant import build_dequant
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARTA_CACHE", str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("kernels")
    specs = [Fp8DequantSpec(333, 520, sparse=True, scale="block", name="dq_sparse_block"),
             Fp8DequantSpec(65, 203, dtype="float16", name="dq_kodd_fp16"),
             Fp8DequantSpec(300, 1032, cols=16, name="dq_c16"), Fp8DequantSpec(77, 44, cols=2, name="dq_k44")]
    try:
        yield [(spec, build_dequant(spec, out)) for spec in specs]
    finally:
        mp.undo()


@needs_build
def test_builds_for_sm89_and_sm90_with_16_byte_loads_and_stores(built):
    for spec, folder in built:
        launch = json.loads((folder / "launch.json").read_text())
        assert sorted(launch["cubins"]) == ["sm_89", "sm_90"] and not launch.get("pdl")
        grid = spec.row_blocks * -(-spec.col_blocks // spec.tile_cols)     # block rows × tiles of block columns
        assert launch["grid"] == [grid, 1, 1] and launch["block"] == [min(256, spec.pieces), 1, 1]
        args = {a["name"]: a["shape"] for a in launch["args"]}
        assert set(args) == {"Wp", "S", "W"} | ({"Tab"} if spec.sparse else set())     # what Fp8DequantOp passes
        assert args["W"] == [spec.n, spec.k] and args["S"] == list(spec.gemv.scale_shape)
        assert args["Wp"] == ([None] if spec.sparse else [spec.row_blocks * spec.col_blocks * BLOCK * BLOCK // 4])
        src = (folder / "kernel.cu").read_text()
        pieces = -(-spec.pieces // 256)                                 # 16-code pieces a thread takes
        assert "cvt.rn.f16x2.e4m3x2" in src and src.count("*(int4*)(wv_ptr") == pieces
        vector = {8: "uint4", 4: "half4", 2: "half2"}.get(math.gcd(spec.k, 8))          # 16-, 8- or 4-byte stores
        assert vector is None or src.count(f"*({vector}*)(W_ptr") == 16 // math.gcd(spec.k, 8) * pieces
        assert vector is not None or src.count("W_ptr[") == 16 * pieces
        assert ("__syncthreads()" in src) == spec.sparse
        assert json.loads((folder / "spec.json").read_text())["name"] == spec.name


@needs_build
def test_launcher_refuses_another_weight_and_cpu_tensors(built):
    spec, folder = built[0]
    op = Fp8DequantOp(folder, spec)
    with pytest.raises(Fp8GemvError, match="table"):                                # a dense weight
        op(pack_weight(weight(spec.n, spec.k), Fp8GemvSpec(spec.n, spec.k, scale="block")))
    packed = pack_weight(weight(spec.n, spec.k), spec.gemv, block_mask(spec.n, spec.k, 0.5))
    with pytest.raises(CudaRuntimeError, match="CUDA"):
        op(packed)
    assert DTYPES[spec.dtype] == op.dtype
