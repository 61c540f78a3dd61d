"""The FP8 GEMV on the GPU against its torch reference (and near the unquantised linear): fp16 and bf16, odd N and K, 0
to 16 rows, dense and block-sparse at 0 to 100% kept blocks, per-channel and 128×128 block scales, bias and
activations, split K (its counters reset after each call), PDL on and off (a chain of launches each reading the last
one's output), leading dimensions, given codes and scales, ``torch.compile`` and a CUDA graph replayed on new inputs.
Kernels are built beforehand where TVM is (``tests/fixtures/build_cuda.py``: the ``f8_*`` fixtures)."""

import pytest
import torch

from sparta.templates.epilogue_ref import activate
from sparta.templates.fp8_gemv.runtime import Fp8GemvOp, Fp8LinearCUDA, folder_spec
from sparta.templates.fp8_gemv.spec import BLOCK, Fp8GemvError, fp8_gemv_ref, quantize

from fixtures.artifacts import MISSING, ROOT
from fixtures.cuda_specs_fp8_gemv import fixture_specs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SPECS = fixture_specs()                       # the fixtures' specs (TVM-free): dense ones are run at density 1 only
CASES = ["f8_r1_bf16", "f8_r1_fp16_nopdl", "f8_r3_sparse_bias_gelu", "f8_r2_kodd_fp16_relu", "f8_r16_ks3_silu_fp16",
         "f8_r16_sparse_ks4_bf16", "f8_r4_sparse_block_tanh", "f8_r1_block_ks2_if8", "f8_r5_sparse_kodd_w1",
         "f8_r4_square_chain", "f8_mma_r1_bf16", "f8_mma_r1_fp16_ks3", "f8_mma_r3_sparse_bias_gelu_fp16",
         "f8_mma_r16_sparse_ks4_bf16", "f8_mma_r9_kodd_block_relu_fp16", "f8_mma_r4_sparse_block_w1_bf16"]
DENSITIES = [0.0, 0.1, 0.5, 1.0]
TOL = {torch.float16: dict(rtol=4e-3, atol=4e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _folder(name):
    folder = ROOT / name
    if not (folder / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    return folder


def _module(name, density=1.0, seed=0) -> Fp8LinearCUDA:
    """The fixture's module on a fresh random weight (no zero in it) and, for a sparse one, a block mask of
    ``density``; packed on the GPU."""
    folder = _folder(name)
    spec = folder_spec(folder)
    dtype = torch.float16 if spec.dtype == "float16" else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(spec.n, spec.k, device="cuda", generator=g) * 0.05
    w = torch.where(w.abs() < 1e-4, torch.full_like(w, 0.01), w).to(dtype)
    mask = torch.rand(spec.row_blocks, spec.col_blocks, device="cuda", generator=g) < density
    bias = (torch.randn(spec.n, device="cuda", generator=g) * 0.1).to(dtype) if spec.bias else None
    module = Fp8LinearCUDA.from_weight(folder, w, bias, block_mask=mask if spec.sparse else None)
    keep = (mask.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:spec.n, :spec.k] if spec.sparse
            else torch.ones(spec.n, spec.k, dtype=torch.bool, device="cuda"))
    module.exact = torch.where(keep, w, torch.zeros_like(w))               # the unquantised (masked) weight
    return module


def _x(module, m, seed, lead=()):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = module.spec
    dtype = torch.float16 if s.dtype == "float16" else torch.bfloat16
    return torch.randn(*lead, m, s.k, device="cuda", generator=g).to(dtype)


def _check(module, x, y, what):
    s = module.spec
    bias = None if module.bias is None else module.bias.cpu()
    want = fp8_gemv_ref(x.cpu(), module.packed.to("cpu"), s, bias)
    assert y.shape == want.shape and y.dtype == x.dtype, what
    scale = max(1.0, float(want.float().abs().max()))
    tol = {k: v * scale for k, v in TOL[x.dtype].items()}
    torch.testing.assert_close(y.float().cpu(), want.float(), **tol, msg=what)
    exact = activate(x.float() @ module.exact.float().t() + (module.bias.float() if module.bias is not None else 0),
                     s.act)
    err = float((y.float() - exact).norm() / exact.norm().clamp_min(1e-6))
    assert err < 0.06 or not module.exact.any(), f"{what}: {err:.3g} from the unquantised linear"


@pytest.mark.parametrize("name, density", [(name, d) for name in CASES
                                           for d in (DENSITIES if SPECS[name].sparse else [1.0])])
def test_matches_the_reference(name, density):
    module = _module(name, density, seed=int(density * 100))
    for m in sorted({m for m in (1, 3, module.spec.rows) if m <= module.spec.rows}):
        x = _x(module, m, seed=m)
        _check(module, x, module(x), f"{name} density {density} M={m}")


@pytest.mark.parametrize("name", ["f8_r1_bf16", "f8_r16_ks3_silu_fp16", "f8_r16_sparse_ks4_bf16",
                                  "f8_mma_r16_sparse_ks4_bf16"])
def test_no_rows_too_many_rows_and_leading_dims(name):
    module = _module(name, 0.5)
    assert module(_x(module, 0, seed=1)).shape == (0, module.spec.n)
    rows = module.spec.rows
    lead = _x(module, 1, seed=2, lead=(rows,)).reshape(rows, 1, module.spec.k)
    y = module(lead)
    assert y.shape == (rows, 1, module.spec.n)
    _check(module, lead.reshape(-1, module.spec.k), y.reshape(-1, module.spec.n), f"{name} leading dims")
    with pytest.raises(Fp8GemvError, match="at most"):
        module(_x(module, rows + 1, seed=3))


@pytest.mark.parametrize("name", ["f8_r16_ks3_silu_fp16", "f8_r16_sparse_ks4_bf16", "f8_r1_block_ks2_if8",
                                  "f8_mma_r1_fp16_ks3", "f8_mma_r9_kodd_block_relu_fp16"])
def test_split_k_counters_reset_between_calls(name):
    module = _module(name, 0.3)
    for seed, m in ((1, module.spec.rows), (2, 1), (3, module.spec.rows), (4, 1)):
        x = _x(module, m, seed)
        _check(module, x, module(x), f"{name} call {seed}")
    assert not module.split_Cnt.any()


@pytest.mark.parametrize("name", ["f8_r4_square_chain", "f8_mma_r4_square_chain"])
def test_pdl_chain_reads_each_output_after_it_is_written(name):
    """Launches back to back, each reading the last one's output (PDL lets each start early; X waits)."""
    module = _module(name)
    x = _x(module, 4, seed=7) / 4
    y = x
    for _ in range(4):
        y = module(y)
    want = x.cpu()
    for _ in range(4):
        want = fp8_gemv_ref(want, module.packed.to("cpu"), module.spec)
    err = (y.float().cpu() - want.float()).abs().max() / want.float().abs().max()
    assert err < 3e-2, f"chain of 4 launches: relative error {err:.3g}"


def test_codes_and_scales_given_and_op_refuses_bad_inputs():
    module = _module("f8_r3_sparse_bias_gelu", 0.5)
    spec = module.spec
    mask = torch.rand(spec.row_blocks, spec.col_blocks, device="cuda") < 0.5
    codes, scales = quantize(module.exact.float(), spec, mask)
    given = Fp8LinearCUDA.from_weight(module.folder, codes, module.bias, block_mask=mask, scales=scales)
    given.exact = module.exact * (codes.float() != 0)
    x = _x(given, 2, seed=1)
    _check(given, x, given(x), "codes given")
    op = Fp8GemvOp(module.folder, spec, module.packed, module.bias)
    _check(module, x, op(x), "op")
    with pytest.raises(Fp8GemvError, match="contiguous"):
        op(x.half() if x.dtype == torch.bfloat16 else x.bfloat16())
    with pytest.raises(Fp8GemvError, match="contiguous"):
        op(torch.cat([x, x], 1)[:, ::2])


def test_runs_inside_torch_compile():
    module = _module("f8_r4_sparse_block_tanh", 0.3)

    def step(x):
        return module(x * 1.5).float().relu()

    compiled = torch.compile(step, fullgraph=True)
    for m in (2, 4, 3):
        x = _x(module, m, seed=m)
        want = fp8_gemv_ref((x * 1.5).cpu(), module.packed.to("cpu"), module.spec, module.bias.cpu()).float().relu()
        torch.testing.assert_close(compiled(x).cpu(), want, **TOL[x.dtype])


@pytest.mark.parametrize("name", ["f8_r1_bf16", "f8_r1_fp16_nopdl", "f8_r16_sparse_ks4_bf16", "f8_mma_r1_bf16"])
def test_a_cuda_graph_replays_on_new_inputs(name):
    module = _module(name, 0.3)
    m = module.spec.rows
    x = _x(module, m, seed=11)
    module(x)                                  # loads the kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(x)
    for seed in (12, 13, 14):
        x.copy_(_x(module, m, seed))
        graph.replay()
        torch.cuda.synchronize()
        _check(module, x, out, f"{name} replay {seed}")
        assert torch.equal(module(x.clone()), out), f"{name}: the replay differs from an eager call"


def test_same_kernel_serves_a_second_weight():
    first, second = _module("f8_r3_sparse_bias_gelu", 0.5, seed=1), _module("f8_r3_sparse_bias_gelu", 0.1, seed=2)
    x = _x(first, 1, seed=5)
    _check(first, x, first(x), "first weight")
    _check(second, x, second(x), "second weight")
    assert not torch.equal(first(x), second(x))
