"""The 2:4 sparse linear on the GPU against its torch reference and the masked dense linear: fp16 and bf16, odd N and
K, 0 to 64 rows, 2:4, 1:4 and 0:4 groups (and all-zero weights), bias and activations, split K (its counters reset
after each call), several row tiles a CTA (the last owning fewer) and prefetched weight fragments, PDL on and off (a
chain of launches each reading the last one's output), leading dimensions, ``torch.compile`` and a CUDA graph
replayed on new inputs. Kernels are built beforehand where TVM is (``tests/fixtures/build_cuda.py``: the ``nm_*``
fixtures)."""

import pytest
import torch

from sparta.templates.epilogue_ref import activate
from sparta.templates.nm_linear.runtime import NmLinearCUDA, NmLinearOp, folder_spec
from sparta.templates.nm_linear.spec import NmLinearError, nm_linear_ref

from fixtures.artifacts import MISSING, ROOT

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CASES = ["nm_r1_bf16", "nm_r1_fp16_nopdl", "nm_r3_bias_gelu", "nm_r8_if4_relu", "nm_r2_kodd_fp16",
         "nm_r16_ks3_silu_fp16", "nm_r16_ks4_if16_bf16", "nm_r4_square_chain", "nm_r32_ks2_bf16",
         "nm_r64_w8_relu_fp16", "nm_r16_t4_ks3_pf_fp16", "nm_r8_t2_pf_gelu", "nm_r1_t8_bf16",
         "nm_r16_t2_kodd_pf_nopdl", "nm_r16_t8_ks2_pf_bf16"]
KEEP = {"2:4": (2,), "mixed": (0, 1, 2), "1:4": (1,), "0:4": (0,)}
TOL = {torch.float16: dict(rtol=4e-3, atol=4e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _folder(name):
    folder = ROOT / name
    if not (folder / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    return folder


def _module(name, keep=(0, 1, 2), seed=0) -> NmLinearCUDA:
    """The fixture's module on a fresh random weight (no zero among its values) and a mask keeping a random count in
    ``keep`` of each group of 4."""
    folder = _folder(name)
    spec = folder_spec(folder)
    dtype = torch.float16 if spec.dtype == "float16" else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(spec.n, spec.k, generator=g)
    w = torch.where(w.abs() < 1e-3, torch.full_like(w, 0.5), w).to(dtype)
    kp = -(-spec.k // 4) * 4
    order = torch.rand(spec.n, kp // 4, 4, generator=g).argsort(-1)
    count = torch.tensor(keep)[torch.randint(len(keep), (spec.n, kp // 4, 1), generator=g)]
    mask = torch.zeros(spec.n, kp // 4, 4, dtype=torch.bool).scatter_(
        -1, order, torch.arange(4).expand(spec.n, kp // 4, 4) < count).view(spec.n, kp)[:, :spec.k]
    bias = torch.randn(spec.n, generator=g).to(dtype) if spec.bias else None
    module = NmLinearCUDA.from_weight(folder, w, bias, mask=mask.contiguous()).cuda()
    module.dense = torch.where(mask, w, torch.zeros_like(w)).cuda()       # for the masked-linear check
    return module


def _x(module, m, seed, lead=()):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = module.spec
    dtype = torch.float16 if s.dtype == "float16" else torch.bfloat16
    return (torch.randn(*lead, m, s.k, device="cuda", generator=g) / s.k ** 0.25).to(dtype)


def _check(module, x, y, what):
    s = module.spec
    want = nm_linear_ref(x.cpu(), module.packed.to("cpu"), s, None if module.bias is None else module.bias.cpu())
    assert y.shape == want.shape and y.dtype == x.dtype, what
    torch.testing.assert_close(y.float().cpu(), want.float(), **TOL[x.dtype], msg=what)
    dense = x.float() @ module.dense.float().t() + (module.bias.float() if module.bias is not None else 0)
    torch.testing.assert_close(y.float(), activate(dense, s.act).to(x.dtype).float(), **TOL[x.dtype], msg=what)


@pytest.mark.parametrize("keep", list(KEEP))
@pytest.mark.parametrize("name", CASES)
def test_matches_the_reference(name, keep):
    module = _module(name, KEEP[keep], seed=len(keep))
    rows = module.spec.rows
    for m in sorted({m for m in (1, 3, 8, 9, 16, rows) if m <= rows}):
        x = _x(module, m, seed=m)
        _check(module, x, module(x), f"{name} {keep} M={m}")


@pytest.mark.parametrize("name", ["nm_r1_bf16", "nm_r16_ks3_silu_fp16"])
def test_no_rows_too_many_rows_and_leading_dims(name):
    module = _module(name)
    assert module(_x(module, 0, seed=1)).shape == (0, module.spec.n)
    lead = _x(module, 1, seed=2, lead=(module.spec.rows,)).reshape(module.spec.rows, 1, module.spec.k)
    y = module(lead)
    assert y.shape == (module.spec.rows, 1, module.spec.n)
    _check(module, lead.reshape(-1, module.spec.k), y.reshape(-1, module.spec.n), f"{name} leading dims")
    with pytest.raises(NmLinearError, match="at most"):
        module(_x(module, module.spec.rows + 1, seed=3))


@pytest.mark.parametrize("name", ["nm_r16_ks3_silu_fp16", "nm_r16_ks4_if16_bf16", "nm_r32_ks2_bf16",
                                  "nm_r16_t4_ks3_pf_fp16", "nm_r16_t8_ks2_pf_bf16"])
def test_split_k_counters_reset_between_calls(name):
    module = _module(name)
    for seed, m in ((1, module.spec.rows), (2, 5), (3, module.spec.rows), (4, 1)):
        x = _x(module, m, seed)
        _check(module, x, module(x), f"{name} call {seed}")
    assert not module.split_Cnt.any()


def test_pdl_chain_reads_each_output_after_it_is_written():
    """Launches back to back, each reading the last one's output (PDL lets each start early; X waits)."""
    module = _module("nm_r4_square_chain", (2,))
    x = _x(module, 4, seed=7)
    y = x
    for _ in range(4):
        y = module(y)
    want = x.cpu()
    for _ in range(4):
        want = nm_linear_ref(want, module.packed.to("cpu"), module.spec)
    err = (y.float().cpu() - want.float()).abs().max() / want.float().abs().max()
    assert err < 3e-2, f"chain of 4 launches: relative error {err:.3g}"


def test_all_zero_weight_gives_the_bias():
    module = _module("nm_r3_bias_gelu", (0,))
    x = _x(module, 3, seed=1)
    want = activate(module.bias.float().expand(3, -1), "gelu").to(x.dtype)
    torch.testing.assert_close(module(x), want, **TOL[x.dtype])


def test_op_refuses_bad_inputs_and_reads_unaligned_rows():
    module = _module("nm_r3_bias_gelu")
    op = NmLinearOp(module.folder, module.spec, module.packed, module.bias)
    x = _x(module, 2, seed=1)
    _check(module, x, op(x), "op")
    with pytest.raises(NmLinearError, match="contiguous"):
        op(x.half())
    with pytest.raises(NmLinearError, match="contiguous"):
        op(torch.cat([x, x], 1)[:, ::2])
    flat = torch.cat([x.new_zeros(4), x.reshape(-1)])[4:].view(2, -1)     # 8 bytes off 16-byte alignment
    _check(module, flat, op(flat), "unaligned x")


def test_runs_inside_torch_compile():
    module = _module("nm_r8_if4_relu")

    def step(x):
        return module(x * 1.5).float().relu()

    compiled = torch.compile(step, fullgraph=True)
    for m in (2, 8, 3):
        x = _x(module, m, seed=m)
        want = nm_linear_ref((x * 1.5).cpu(), module.packed.to("cpu"), module.spec, module.bias.cpu()).float().relu()
        torch.testing.assert_close(compiled(x).cpu(), want, **TOL[x.dtype])


@pytest.mark.parametrize("name", ["nm_r1_bf16", "nm_r1_fp16_nopdl", "nm_r16_ks4_if16_bf16", "nm_r16_t8_ks2_pf_bf16"])
def test_a_cuda_graph_replays_on_new_inputs(name):
    module = _module(name)
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


def test_same_kernel_serves_a_second_weight_packed_on_the_gpu():
    first, second = _module("nm_r1_bf16", seed=1), _module("nm_r1_bf16", (2,), seed=2)
    x = _x(first, 1, seed=5)
    _check(first, x, first(x), "first weight")
    _check(second, x, second(x), "second weight")
    assert not torch.equal(first(x), second(x))
    on_gpu = NmLinearCUDA.from_weight(first.folder, second.dense, None)   # packed on the GPU from the nonzeros
    assert torch.equal(on_gpu.values.cpu(), second.values.cpu()) and torch.equal(on_gpu.meta.cpu(), second.meta.cpu())
    assert torch.equal(on_gpu(x), second(x))
