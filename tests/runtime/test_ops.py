"""sparta's kernels as ``torch.library`` ops: opcheck, torch.compile without graph breaks, torch.export, fake tensors.

CPU kernels run here; a model compiled for CUDA is traced with fake CUDA tensors (no GPU needed)."""

import copy
import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import sparta
from sparta.templates.onednn_int8 import runtime as cpu_int8
from sparta.runtime.ops import kernel_module
from sparta.templates.registry import families

pytest.importorskip("tvm", reason="compiles models (the GPU machine has no TVM: test_ops_cuda.py runs there)")


def block_mask(n, k, block, density, seed):
    g = torch.Generator().manual_seed(seed)
    grid = torch.rand(n // block, k // block, generator=g) < density
    grid[0, 0] = True
    return grid.repeat_interleave(block, 0).repeat_interleave(block, 1)


class MLP(torch.nn.Module):
    def __init__(self, d=96, h=160):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))) + x


@pytest.fixture(scope="module")
def sparse_cpu():
    torch.manual_seed(0)
    model = MLP().eval()
    tesa = {"up.weight": block_mask(160, 96, 32, 0.4, 1), "down.weight": block_mask(96, 160, 16, 0.3, 2)}
    x = torch.randn(2, 37, 96)
    return sparta.compile(model, tesa, (x,), dynamic=False), x      # kernels of one M (dynamic: test_dynamic.py)


def kernel_modules(compiled):
    return [m for m in compiled.module_replacements().values() if getattr(m, "kernel_family", "")]


def test_every_family_is_a_registered_op():
    for family in (f.name for f in families() if f.module):
        assert hasattr(torch.ops.sparta, family), family


def test_cpu_linear_op_passes_opcheck(sparse_cpu):
    compiled, x = sparse_cpu
    modules = kernel_modules(compiled)
    assert {m.kernel_family for m in modules} == {"cpu_linear"} and len(modules) == 2
    for m in modules:
        x2 = torch.randn(74, m.k_pad)
        torch.library.opcheck(torch.ops.sparta.cpu_linear.default, (m.kernel_key, [x2], m.kernel_weights()))


def test_torch_compile_fullgraph_and_export_match_the_compiled_model(sparse_cpu):
    compiled, x = sparse_cpu
    x = torch.randn_like(x)
    with torch.no_grad():
        want = compiled(x)
        got = torch.compile(compiled, fullgraph=True)(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        ep = torch.export.export(compiled, (x,))
        calls = [n for n in ep.graph.nodes if n.op == "call_function" and "sparta" in str(n.target)]
        assert len(calls) == 2
        torch.testing.assert_close(ep.module()(x), want, rtol=1e-6, atol=1e-6)


def test_a_deep_copy_runs_its_own_kernels(sparse_cpu):
    compiled, x = sparse_cpu
    clone = copy.deepcopy(compiled)
    keys = {m.kernel_key for m in kernel_modules(compiled)}
    assert not keys & {m.kernel_key for m in kernel_modules(clone)}
    with torch.no_grad():
        torch.testing.assert_close(clone(x), compiled(x))


def test_an_unknown_kernel_is_a_clear_error():
    with pytest.raises(sparta.SpartaError, match="no live sparta kernel"):
        torch.ops.sparta.cpu_linear("nothing#0", [torch.randn(4, 4)], [])


def test_a_kernel_called_with_other_rows_says_so(sparse_cpu):
    compiled, _ = sparse_cpu
    m = kernel_modules(compiled)[0]
    with pytest.raises(sparta.SpartaError, match="built for 74 rows"):
        m(torch.randn(5, m.k))


@pytest.mark.skipif(not cpu_int8.available(), reason="torch here has no oneDNN int8 linear")
def test_int8_linear_op_passes_opcheck_and_compiles():
    torch.manual_seed(0)
    model = MLP().eval()
    batches = [(torch.randn(2, 37, 96),) for _ in range(2)]
    compiled = sparta.compile(model, {}, batches[0], calibration=batches,
                              quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    modules = kernel_modules(compiled)
    assert {m.kernel_family for m in modules} == {"onednn_int8"}
    for m in modules:
        u = torch.randint(0, 256, (74, m.k), dtype=torch.uint8)
        torch.library.opcheck(torch.ops.sparta.onednn_int8.default, (m.kernel_key, [u], m.kernel_weights()))
    x = torch.randn(2, 37, 96)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(compiled, fullgraph=True)(x), compiled(x), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_cuda_model_propagates_fake_cuda_tensors():
    """Compiled for CUDA here (kernels built, no GPU), the model runs on fake CUDA tensors: every sparta op's fake
    implementation gives the output the kernel would, and torch.export traces it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
                                torch.nn.LayerNorm(1024)).eval()
    x = torch.randn(3, 333, 1024)
    compiled = sparta.compile(model, {"0.weight": block_mask(2048, 1024, 32, 0.15, 3)}, (x,), target="cuda")
    assert {m.kernel_family for m in kernel_modules(compiled)} == {"bsr_linear"}
    ep = torch.export.export(compiled, (x,))
    assert any(n.op == "call_function" and "sparta.bsr_linear" in str(n.target) for n in ep.graph.nodes)
    with FakeTensorMode():
        state = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda")
                 for k, v in [*compiled.module.named_parameters(), *compiled.module.named_buffers()]}
        (out,) = torch.func.functional_call(compiled.module, state, (torch.empty(3, 333, 1024, device="cuda"),))
        assert out.device.type == "cuda" and out.shape == (3, 333, 1024) and out.dtype == torch.float32
    assert kernel_module(kernel_modules(compiled)[0].kernel_key) is kernel_modules(compiled)[0]


def test_calls_run_through_inductor_where_asked(sparse_cpu):
    """``inductor`` picks the torch.compile mode a model's calls run under: none on the CPU by default, any mode on
    request (same outputs), refused when unknown; a model compiled for CUDA defaults to CUDA graphs."""
    compiled, x = sparse_cpu
    assert compiled.inductor is None
    with torch.no_grad():
        want = compiled(x)
        try:
            compiled.inductor = True
            assert compiled.inductor == "default"
            torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
            assert compiled._inductor_fn is not None
        finally:
            compiled.inductor = False
    assert compiled.inductor is None and compiled._inductor_fn is None
    with pytest.raises(sparta.SpartaError, match="inductor must be"):
        compiled.inductor = "fastest"
    with pytest.raises(sparta.SpartaError, match="inductor must be"):
        sparta.compile(MLP().eval(), {}, (x,), inductor="fastest")
    cuda = sparta.compile(torch.nn.Linear(64, 64).eval(), {}, (torch.randn(8, 64),), target="cuda")
    assert cuda.inductor == "cudagraph"
