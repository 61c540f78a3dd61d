"""The bitmap GEMV on the GPU against its torch reference and the masked dense linear: fp16 and bf16, odd N and K, 0
to 16 rows, densities 0 to 1, bias and activations, every tiling knob, split K (its counters reset after each call),
PDL on and off (a chain of launches each reading the last one's output), tensor cores, leading dimensions, ``torch.compile`` and a
CUDA graph replayed on new inputs. Kernels are built beforehand where TVM is (``tests/fixtures/build_cuda.py``: the
``bm_*`` fixtures)."""

import pytest
import torch

from sparta.templates.bitmap_gemv.runtime import BitmapGemvOp, BitmapLinearCUDA
from sparta.templates.bitmap_gemv.spec import BitmapGemvError, bitmap_gemv_ref, pack_bitmap
from sparta.templates.epilogue_ref import activate

from fixtures.artifacts import MISSING, ROOT

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CASES = ["bm_r1_bf16", "bm_r1_fp16_nopdl", "bm_r3_bias_gelu", "bm_r4_t32_c256_relu", "bm_r2_kodd_fp16",
         "bm_r1_t16_c512_if16", "bm_r16_ks3_silu_fp16", "bm_r16_ks4_bf16", "bm_r4_square_chain",
         "bm_mma_r16_ks2_bf16", "bm_mma_r5_fp16_silu", "bm_mma_r1_kodd"]
DENSITIES = [0.0, 0.1, 0.3, 0.5, 1.0]
TOL = {torch.float16: dict(rtol=4e-3, atol=4e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _folder(name):
    folder = ROOT / name
    if not (folder / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    return folder


def _module(name, density, seed=0) -> BitmapLinearCUDA:
    """The fixture's module on a fresh random weight (no zero among its values) and mask of ``density``."""
    folder = _folder(name)
    from sparta.templates.bitmap_gemv.runtime import folder_spec
    spec = folder_spec(folder)
    dtype = torch.float16 if spec.dtype == "float16" else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(spec.n, spec.k, generator=g)
    w = torch.where(w.abs() < 1e-3, torch.full_like(w, 0.5), w).to(dtype)
    mask = torch.rand(spec.n, spec.k, generator=g) < density
    bias = torch.randn(spec.n, generator=g).to(dtype) if spec.bias else None
    module = BitmapLinearCUDA.from_weight(folder, w, mask, bias).cuda()
    module.dense = torch.where(mask, w, torch.zeros_like(w)).cuda()       # for the masked-linear check
    return module


def _x(module, m, seed, lead=()):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = module.spec
    dtype = torch.float16 if s.dtype == "float16" else torch.bfloat16
    return (torch.randn(*lead, m, s.k, device="cuda", generator=g) / s.k ** 0.5).to(dtype)


def _check(module, x, y, what):
    s = module.spec
    want = bitmap_gemv_ref(x.cpu(), module.packed.to("cpu"), s, None if module.bias is None else module.bias.cpu())
    assert y.shape == want.shape and y.dtype == x.dtype, what
    torch.testing.assert_close(y.float().cpu(), want.float(), **TOL[x.dtype], msg=what)
    dense = x.float() @ module.dense.float().t() + (module.bias.float() if module.bias is not None else 0)
    torch.testing.assert_close(y.float(), activate(dense, s.act).to(x.dtype).float(), **TOL[x.dtype], msg=what)


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("name", CASES)
def test_matches_the_reference(name, density):
    module = _module(name, density, seed=int(density * 100))
    for m in sorted({m for m in (1, 3, module.spec.rows) if m <= module.spec.rows}):
        x = _x(module, m, seed=m)
        _check(module, x, module(x), f"{name} density {density} M={m}")


@pytest.mark.parametrize("name", ["bm_r1_bf16", "bm_r16_ks3_silu_fp16"])
def test_no_rows_too_many_rows_and_leading_dims(name):
    module = _module(name, 0.5)
    x0 = _x(module, 0, seed=1)
    assert module(x0).shape == (0, module.spec.n)
    lead = _x(module, 1, seed=2, lead=(module.spec.rows,)).reshape(module.spec.rows, 1, module.spec.k)
    y = module(lead)
    assert y.shape == (module.spec.rows, 1, module.spec.n)
    _check(module, lead.reshape(-1, module.spec.k), y.reshape(-1, module.spec.n), f"{name} leading dims")
    with pytest.raises(BitmapGemvError, match="at most"):
        module(_x(module, module.spec.rows + 1, seed=3))


@pytest.mark.parametrize("name", ["bm_r16_ks3_silu_fp16", "bm_r16_ks4_bf16", "bm_mma_r16_ks2_bf16"])
def test_split_k_counters_reset_between_calls(name):
    module = _module(name, 0.3)
    for seed, m in ((1, 16), (2, 5), (3, 16), (4, 1)):
        x = _x(module, m, seed)
        _check(module, x, module(x), f"{name} call {seed}")
    assert not module.split_Cnt.any()


def test_pdl_chain_reads_each_output_after_it_is_written():
    """Launches back to back, each reading the last one's output (PDL lets each start early; X waits)."""
    module = _module("bm_r4_square_chain", 0.5)
    x = _x(module, 4, seed=7)
    y = x
    for _ in range(4):
        y = module(y)
    want = x.cpu()
    for _ in range(4):
        want = bitmap_gemv_ref(want, module.packed.to("cpu"), module.spec)
    err = (y.float().cpu() - want.float()).abs().max() / want.float().abs().max()
    assert err < 3e-2, f"chain of 4 launches: relative error {err:.3g}"


def test_op_refuses_bad_inputs():
    module = _module("bm_r3_bias_gelu", 0.5)
    op = BitmapGemvOp(module.folder, module.spec, module.packed, module.bias)
    x = _x(module, 2, seed=1)
    _check(module, x, op(x), "op")
    with pytest.raises(BitmapGemvError, match="contiguous"):
        op(x.half())
    with pytest.raises(BitmapGemvError, match="contiguous"):
        op(torch.cat([x, x], 1)[:, ::2])


def test_runs_inside_torch_compile():
    module = _module("bm_r4_t32_c256_relu", 0.3)

    def step(x):
        return module(x * 1.5).float().relu()

    compiled = torch.compile(step, fullgraph=True)
    for m in (2, 4, 3):
        x = _x(module, m, seed=m)
        want = bitmap_gemv_ref((x * 1.5).cpu(), module.packed.to("cpu"), module.spec, module.bias.cpu()).float().relu()
        torch.testing.assert_close(compiled(x).cpu(), want, **TOL[x.dtype])


@pytest.mark.parametrize("name", ["bm_r1_bf16", "bm_r1_fp16_nopdl", "bm_r16_ks4_bf16", "bm_mma_r16_ks2_bf16"])
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
        eager = module(x.clone())
        assert torch.equal(eager, out), f"{name}: the replay differs from an eager call"


def test_same_kernel_serves_a_second_weight():
    first, second = _module("bm_r1_bf16", 0.5, seed=1), _module("bm_r1_bf16", 0.1, seed=2)
    x = _x(first, 1, seed=5)
    _check(first, x, first(x), "first weight")
    _check(second, x, second(x), "second weight")
    assert not torch.equal(first(x), second(x))
    assert pack_bitmap(second.dense.cpu(), second.dense.cpu() != 0, second.spec).values.numel() == \
        second.values.numel()
