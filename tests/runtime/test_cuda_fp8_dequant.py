"""The FP8 dequantisation kernel on the GPU against its torch reference, bit for bit: dense and block-sparse at 0 to
100% kept blocks (pruned blocks written as zeros over a buffer of NaNs), per-channel and block scales, fp16 and bf16,
odd N and K; a CUDA graph replayed on new codes and scales; bad output buffers refused. Kernels are built beforehand
where TVM is (``tests/fixtures/build_cuda.py``: the ``f8dq_*`` fixtures)."""

import pytest
import torch

from sparta.templates.fp8_gemv.dequant import Fp8DequantOp, dequant_ref
from sparta.templates.fp8_gemv.spec import BLOCK, DTYPES, Fp8GemvError, element_mask, pack_weight

from fixtures.artifacts import MISSING, ROOT
from fixtures.cuda_specs_fp8_dequant import fixture_specs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SPECS = fixture_specs()
DENSITIES = [0.0, 0.1, 0.5, 1.0]


def _op(name) -> Fp8DequantOp:
    folder = ROOT / name
    if not (folder / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    return Fp8DequantOp(folder, SPECS[name])


def _packed(spec, density, seed, mask=None):
    """A fresh random weight (no zero in it) of the spec's dtype packed on the GPU, keeping the blocks of ``mask`` (a
    random one of ``density`` if None) for a sparse spec; and the (N, K) kept mask."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(spec.n, spec.k, device="cuda", generator=g) * 0.05
    w = torch.where(w.abs() < 1e-4, torch.full_like(w, 0.01), w).to(DTYPES[spec.dtype])
    if mask is None:
        mask = torch.rand(spec.row_blocks, spec.col_blocks, device="cuda", generator=g) < density
    if not spec.sparse:
        mask = torch.ones_like(mask)
    return pack_weight(w, spec.gemv, mask if spec.sparse else None), mask


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("name, density", [(name, d) for name in SPECS
                                           for d in (DENSITIES if SPECS[name].sparse else [1.0])])
def test_kernel_writes_the_reference_bit_for_bit(name, density):
    op, spec = _op(name), SPECS[name]
    packed, mask = _packed(spec, density, seed=int(density * 100))
    want = dequant_ref(packed, spec)
    assert torch.equal(_bits(want.cpu()), _bits(dequant_ref(packed.to("cpu"), spec)))
    got = op(packed)
    assert got.shape == (spec.n, spec.k) and got.dtype == DTYPES[spec.dtype] and got.device == packed.codes.device
    assert torch.equal(_bits(got), _bits(want))
    keep = element_mask(mask, spec.n, spec.k)
    assert not _bits(got)[~keep].any() and bool(got[keep].ne(0).all())
    out = torch.full((spec.n, spec.k), float("nan"), dtype=want.dtype, device="cuda")
    assert op(packed, out=out) is out and torch.equal(_bits(out), _bits(want)), "every element written"


@pytest.mark.parametrize("name", ["f8dq_sparse_block_bf16", "f8dq_kodd_block_fp16", "f8dq_dense_bf16"])
def test_kernel_replays_in_a_cuda_graph_on_new_codes_and_scales(name):
    op, spec = _op(name), SPECS[name]
    packed, mask = _packed(spec, 0.5, seed=1)
    out = torch.empty(spec.n, spec.k, dtype=DTYPES[spec.dtype], device="cuda")
    op(packed, out=out)                                  # loads the kernel, prepares the launch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(packed, out=out)
    for seed in (2, 3):
        new, _ = _packed(spec, 0.5, seed, mask)          # the same blocks kept: the same sizes
        for t, v in zip(packed.tensors(), new.tensors()):
            t.copy_(v)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(out), _bits(dequant_ref(new, spec))), seed


def test_bad_output_buffers_are_refused():
    name = "f8dq_dense_bf16"
    op, spec = _op(name), SPECS[name]
    packed, _ = _packed(spec, 1.0, seed=4)
    n, k, dtype = spec.n, spec.k, DTYPES[spec.dtype]
    bad = {"shape": torch.empty(n, k - 8, dtype=dtype, device="cuda"),
           "dtype": torch.empty(n, k, dtype=torch.float32, device="cuda"),
           "strides": torch.empty(k, n, dtype=dtype, device="cuda").t(),
           "device": torch.empty(n, k, dtype=dtype),
           "alignment": torch.empty(n * k + 1, dtype=dtype, device="cuda")[1:].view(n, k)}
    for what, out in bad.items():
        with pytest.raises(Fp8GemvError, match="aligned" if what == "alignment" else "contiguous"):
            op(packed, out=out)
    with pytest.raises(Fp8GemvError, match="codes"):
        op(type(packed)(packed.codes[:-4], packed.scales))
    assert torch.equal(_bits(op(packed)), _bits(dequant_ref(packed, spec)))


def test_pruned_blocks_are_written_between_calls_on_one_buffer():
    """One buffer for several weights (a transient buffer reused): each call leaves no element of the last one."""
    name = "f8dq_sparse_kodd_c2_bf16"
    op, spec = _op(name), SPECS[name]
    out = torch.empty(spec.n, spec.k, dtype=DTYPES[spec.dtype], device="cuda")
    for seed, density in ((5, 1.0), (6, 0.3), (7, 0.0), (8, 0.7)):
        packed, _ = _packed(spec, density, seed)
        op(packed, out=out)
        assert torch.equal(_bits(out), _bits(dequant_ref(packed, spec))), (seed, density)
    assert out.shape[1] % BLOCK and out.shape[1] % 8               # row ends of K % 8 != 0
