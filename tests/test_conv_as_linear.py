"""1×1 convolutions pruned inside channels run as linears over channels on CUDA (``passes/conv_as_linear.py``): the
rewritten graph computes the masked model, a CUDA plan gives them the block-sparse linear kernels, and the CPU
target still runs (and equals) the masked convolutions."""

import warnings

import pytest
import torch
from cnn_models import Bottleneck, randomize
from torch import nn

import sparta
from sparta.backend.fx import to_graph_module
from sparta.compiled_model import masked_weights
from sparta.passes.conv_as_linear import pruned_inside_channels
from sparta.pipeline import CompileContext, CompileOptions, run_pass
from sparta.tesa import TeSA


def block_masks(model: nn.Module, density: float, block: int = 32, seed: int = 0) -> dict:
    """A ``block``×``block`` (output × input channel) mask of ``density`` for every 1×1 convolution's weight."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if p.ndim == 4 and tuple(p.shape[2:]) == (1, 1):
            n, k = p.shape[:2]
            blocks = torch.rand(-(-n // block), -(-k // block), generator=g) < density
            out[name] = blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k].reshape(p.shape)
    return out


def masked_model(model: nn.Module, masks: dict) -> nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in masks:
                p.mul_(masks[name])
    return model


def rewritten(model, masks, x):
    """The graph after ``conv_as_linear`` (capture, TeSAs, simplification, BatchNorms folded first)."""
    ctx = CompileContext(model, CompileOptions(target="cuda", initial_tesa=masks, example_inputs=(x,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("capture", "attach_tesa", "simplify", "fold_bn", "conv_as_linear"):
            run_pass(ctx, name)
    return ctx


@pytest.mark.parametrize("stride, size", [(1, 14), (2, 15)])
def test_the_rewritten_graph_computes_the_masked_model(stride, size):
    torch.manual_seed(stride)
    model = randomize(Bottleneck(96, 40, stride=stride))
    masks = block_masks(model, 0.3)
    ctx = rewritten(model, masks, torch.randn(2, 96, size, size))
    linears = [op for op in ctx.graph.ops("linear")]
    assert len(linears) == 3 and not any(op.attrs.get("groups") for op in linears)
    assert [ctx.graph.tensor(op.input_of("weight")).shape[2:] for op in ctx.graph.ops("conv2d")] == [(3, 3)]
    assert len(list(ctx.graph.ops("slice"))) == (2 if stride == 2 else 0)        # the strided downsample's input
    assert ctx.graph.tesa("conv1.weight").shape == (40, 96)                         # the name reads the matrix
    assert all(m in ctx.folded for m in (op.inputs[1] for op in linears))
    module = to_graph_module(ctx.graph, masked_weights(ctx.graph))
    reference = masked_model(model, masks)
    for batch in (1, 3):
        x = torch.randn(batch, 96, size, size)
        for xin in (x, x.to(memory_format=torch.channels_last)):
            with torch.no_grad():
                torch.testing.assert_close(module(xin)[0], reference(x), rtol=1e-4, atol=1e-4)


def test_only_weights_pruned_inside_channels_are_rewritten():
    w = torch.randn(64, 48, 1, 1)
    rows = torch.rand(64) < 0.5
    cols = torch.rand(48) < 0.5
    channels = (rows[:, None] & cols[None, :]).reshape(w.shape)
    assert not pruned_inside_channels(TeSA.dense(w.shape, 16), 16)
    assert not pruned_inside_channels(TeSA.from_mask(channels, 16), 16)
    assert pruned_inside_channels(TeSA.from_mask(channels, 8), 16)                  # fewer bits: a kernel's job
    inside = channels.clone()
    inside[rows.nonzero()[0, 0], cols.nonzero()[0, 0]] = False
    assert pruned_inside_channels(TeSA.from_mask(inside, 16), 16)
    assert pruned_inside_channels(TeSA.from_mask(torch.rand(w.shape) < 0.5, 16), 16)

    model = randomize(Bottleneck(64, 16))
    dense = rewritten(model, {}, torch.randn(1, 64, 8, 8))
    assert not list(dense.graph.ops("linear"))
    shrinkable = {"conv1.weight": (torch.rand(16) < 0.5)[:, None, None, None].expand(16, 64, 1, 1)}
    assert not list(rewritten(model, shrinkable, torch.randn(1, 64, 8, 8)).graph.ops("linear"))


def test_a_cuda_plan_runs_block_sparse_1x1_convolutions_on_bsr_linear():
    """A ResNet bottleneck (fp16) with 90% of the 32×32 blocks of its 1×1 weights pruned, compiled for CUDA here
    (no GPU): the 1×1 convolutions are linears on the block-sparse tile kernels, ReLU in conv1's epilogue; the 3×3
    stays torch's convolution."""
    torch.manual_seed(0)
    model = randomize(Bottleneck(512, 256, stride=2)).half()
    masks = block_masks(model, 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = sparta.compile(model, masks, (torch.randn(8, 512, 28, 28).half(),), target="cuda")
    plan = compiled.plan
    matrices = {p.weight: p for p in plan.ops.values() if p.weight and p.weight.endswith("_matrix")}
    assert len(matrices) == 3, compiled.plan_report()
    for p in matrices.values():
        assert (p.op_type, p.kind, p.kernel.kernel) == ("linear", "sparse", "bsr_linear"), compiled.plan_report()
        assert p.density < 0.2
    conv1 = next(p for w, p in matrices.items() if w.startswith("conv1."))
    assert conv1.epilogue == ["bias", "relu"]                 # conv1 + bn1 + ReLU: one kernel
    assert [p.kind for p in plan.ops.values() if p.op_type == "conv2d"] == ["dense"]
    assert "bsr_linear[float16" in compiled.plan_report()


def test_the_cpu_target_keeps_the_convolutions_and_equals_the_masked_model():
    torch.manual_seed(1)
    model = randomize(Bottleneck(128, 32, stride=2))
    masks = block_masks(model, 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = sparta.compile(model, masks, (torch.randn(2, 128, 9, 9),), target="cpu")
    assert not list(compiled.graph.ops("linear"))
    assert len(list(compiled.graph.ops(("conv2d", "mkldnn_convolution")))) == 4
    reference = masked_model(model, masks)
    for batch in (1, 3):
        x = torch.randn(batch, 128, 9, 9)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
