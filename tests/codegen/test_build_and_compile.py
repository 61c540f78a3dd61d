"""Build cache, thread pool, and sparta.compile on the CPU with real kernels."""

import time

import torch
from models import MLP

import sparta
from sparta import TeSA
from sparta.codegen import cache
from sparta.codegen.build import build_cpu
from sparta.codegen.tvm_env import num_threads
from sparta.templates.cpu_linear.block import block_linear
from sparta.templates.cpu_linear.block_spec import BlockLinearSpec


def test_thread_pool_uses_all_cores():
    import os
    assert num_threads() == len(os.sched_getaffinity(0))


def test_cache_hits_and_rebuilds_corrupt_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BlockLinearSpec(8, 32, 32, (32, 32), ((0,),), name="cache_probe")
    first = build_cpu(block_linear, spec)
    assert not first.cached
    t0 = time.perf_counter()
    second = build_cpu(block_linear, spec)
    assert second.cached and second.key == first.key and time.perf_counter() - t0 < first.build_s
    lib = tmp_path / first.key / "kernel.so"
    lib.unlink()                       # a new inode: the library loaded above stays mapped intact
    lib.write_bytes(b"garbage")
    third = build_cpu(block_linear, spec)
    assert not third.cached and (tmp_path / first.key / "kernel.so").stat().st_size > 100
    other = build_cpu(block_linear, BlockLinearSpec(8, 32, 32, (32, 32), ((),), name="cache_probe"))
    assert other.key != first.key, "another sparsity is another kernel"
    assert cache.lookup("nope", "kernel.so") is None


def block_mask(shape, block, density, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(-(-shape[0] // block), -(-shape[1] // block), generator=g) < density
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


def test_compile_mlp_runs_kernels_and_matches_masked_reference():
    torch.manual_seed(0)
    model = MLP(d_in=128, d_hidden=256, d_out=10).eval()
    x = torch.randn(67, 128)
    tesa = {"fc1.weight": TeSA.from_mask(block_mask((256, 128), 32, 0.15, 1)),
            "fc2.weight": TeSA.from_mask(torch.rand(256, 256) < 0.03)}
    compiled = sparta.compile(model, tesa, (x,), verify=True)
    kinds = {k["op"]: k["template"] for k in compiled.kernels}
    assert kinds["linear"] == "block_sparse" and kinds["linear_1"] == "fine_sparse"
    calls = [n.target for n in compiled.module.graph.nodes if n.op == "call_module"]
    assert "kernel_linear" in calls and "kernel_relu" in calls, "relu is fused into the first kernel"
    ref = MLP(d_in=128, d_hidden=256, d_out=10).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref.fc1.weight.mul_(tesa["fc1.weight"].mask)
        ref.fc2.weight.mul_(tesa["fc2.weight"].mask)
        x2 = torch.randn(67, 128)
        torch.testing.assert_close(compiled(x2), ref(x2), rtol=1e-4, atol=1e-4)
    assert "fc1.weight" not in dict(compiled.module.named_buffers()) | dict(compiled.module.named_parameters())
    assert "block_sparse" in compiled.kernel_report()


def test_odd_shapes_pad_and_slice():
    lin = torch.nn.Linear(197, 301).eval()
    x = torch.randn(4, 51, 197)
    compiled = sparta.compile(lin, {"weight": TeSA.from_mask(block_mask((301, 197), 16, 0.1, 2))}, (x,), verify=True)
    assert compiled.kernels and compiled(x).shape == (4, 51, 301)


def test_int8_weights_and_activations_use_the_int8_kernel():
    lin = torch.nn.Linear(128, 64).eval()
    x = torch.randn(32, 128)
    mask = block_mask((64, 128), 32, 0.5, 3)
    graph_bits = {"weight": TeSA.from_mask(mask, bits=8), "input": TeSA.dense((32, 128), 8)}
    compiled = sparta.compile(lin, graph_bits, (x,))
    assert any(k["bits"] == "W8A8" for k in compiled.kernels)
    errs = compiled.verify()
    assert max(errs.values()) < 5e-2


def test_cuda_target_plans_without_cpu_kernels():
    compiled = sparta.compile(torch.nn.Linear(64, 64).eval(), {"weight": TeSA.from_mask(block_mask((64, 64), 32, 0.5, 4))},
                              (torch.randn(8, 64),), target="cuda")
    assert compiled.plan.target == "cuda" and compiled.kernels == []


class TwoLayers(torch.nn.Module):
    def __init__(self, d=512):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        return self.b(self.a(x))


def test_large_ops_share_one_generic_kernel_and_dismantle_can_be_forced():
    torch.manual_seed(1)
    model = TwoLayers().eval()
    x = torch.randn(64, 512)
    tesa = {"a.weight": block_mask((512, 512), 32, 0.25, 3), "b.weight": block_mask((512, 512), 32, 0.25, 4)}
    compiled = sparta.compile(model, tesa, (x,), verify=True)
    assert {k["dismantle"] for k in compiled.kernels} == {"none"}
    assert len({k["key"] for k in compiled.kernels}) == 1, "both layers run the same generic kernel"
    forced = sparta.compile(model, tesa, (x,), verify=True, dismantle="full")
    assert {k["dismantle"] for k in forced.kernels} == {"full"}
    assert len({k["key"] for k in forced.kernels}) == 2, "dismantled kernels are specialised per layer"
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), forced(x), rtol=1e-4, atol=1e-4)
