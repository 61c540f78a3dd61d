"""Convolutions on the conv2d family in CUDA plans (``codegen/select_conv.py``, ``templates/conv2d/select.py``): a
block-pruned 3x3 convolution whose kept blocks make the kernel cheaper than cuDNN gets it (bias and ReLU in its
epilogue), a dense, barely pruned, fp32 or grouped one does not, and codegen builds the module it names. Compiled
here for CUDA (no GPU: TVM and nvcc build the kernels)."""

import warnings

import pytest
import torch
from cnn_models import BasicBlock, randomize

import sparta
from sparta.templates.conv2d.runtime import Conv2dCUDA
from sparta.templates.conv2d.spec import Conv2dSpec, expand_block_mask


def conv_masks(model, density: float, seed: int = 0) -> dict:
    """A mask of (64 output channels x (tap, 32 input channels)) blocks of ``density`` for every 3x3 weight."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if p.ndim == 4 and tuple(p.shape[2:]) == (3, 3):
            co, ci = p.shape[:2]
            spec = Conv2dSpec(ci, co, 8, 8, bn=64, bk=32)
            out[name] = expand_block_mask(torch.rand(spec.row_blocks, spec.k_blocks, generator=g) < density, spec)
    return out


def _compile(model, masks, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sparta.compile(model, masks, (x,), target="cuda")


def _convs(compiled):
    return {n: p for n, p in compiled.plan.ops.items() if p.op_type == "conv2d"}


def test_block_pruned_3x3_convolutions_run_on_the_conv2d_kernel():
    torch.manual_seed(0)
    model = randomize(BasicBlock(256, 256)).half()
    compiled = _compile(model, conv_masks(model, 0.2), torch.randn(4, 256, 14, 14).half())
    convs = _convs(compiled)
    assert len(convs) == 2
    for p in convs.values():
        assert (p.kind, p.kernel.kernel, p.kernel.rule) == ("sparse", "conv2d", "block_sparse_conv"), p
        assert p.est_us < p.dense_us and p.subops[0].block == (64, 32) and 0 < p.subops[0].n_blocks < 288 * 0.35
    first = compiled.graph.op(next(iter(convs)))
    assert convs[first.name].epilogue == ["bias", "relu"]                 # BN folded into the bias, ReLU fused
    assert any(g.kind == "epilogue" and g.anchor == first.name for g in compiled.plan.fusions)
    modules = compiled.module_replacements()
    assert all(isinstance(modules[n], Conv2dCUDA) for n in convs)
    assert modules[first.name].spec.act == "relu" and modules[first.name].spec.bias
    assert torch.equal(modules[first.name].block_mask.sum(), torch.tensor(convs[first.name].subops[0].n_blocks))
    report = compiled.kernel_report()
    assert report.count("conv2d ") >= 2 and "x64x32" in report
    assert "conv2d[float16 128x64x32] +bias+relu" in compiled.plan_report()


@pytest.mark.parametrize("case", ["dense", "barely_pruned", "fp32"])
def test_convolutions_the_kernel_does_not_pay_for_stay_on_cudnn(case):
    torch.manual_seed(1)
    model = randomize(BasicBlock(128, 128))
    model = model if case == "fp32" else model.half()
    masks = {} if case == "dense" else conv_masks(model, 0.95 if case == "barely_pruned" else 0.2)
    x = torch.randn(2, 128, 14, 14)
    compiled = _compile(model, masks, x if case == "fp32" else x.half())
    convs = _convs(compiled)
    assert convs and all(p.kind == "dense" and p.kernel is None for p in convs.values())
    assert not any(isinstance(m, Conv2dCUDA) for m in compiled.module_replacements().values())
    why = [c.description for p in convs.values() for c in p.candidates if c.name == "conv2d"]
    if case == "barely_pruned":
        assert why and all("is not below cuDNN" in w for w in why)
    elif case == "fp32":
        assert why and all("runs fp16 and bf16" in w for w in why)
    else:
        assert not why                                           # nothing pruned: not even asked


def test_the_cpu_target_leaves_convolutions_to_torch():
    model = randomize(BasicBlock(64, 64))
    masks = conv_masks(model, 0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = sparta.compile(model, masks, (torch.randn(2, 64, 8, 8),), target="cpu")
    assert all(p.kernel is None or p.kernel.kernel != "conv2d" for p in compiled.plan.ops.values())
    x = torch.randn(3, 64, 8, 8)
    reference = randomize(BasicBlock(64, 64))
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name in masks:
                p.mul_(masks[name])
        torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)


def test_a_saved_model_loads_its_conv2d_modules(tmp_path):
    torch.manual_seed(2)
    model = randomize(BasicBlock(256, 256)).half()
    compiled = _compile(model, conv_masks(model, 0.2, seed=3), torch.randn(4, 256, 14, 14).half())
    built = {n: m for n, m in compiled.module_replacements().items() if isinstance(m, Conv2dCUDA)}
    assert len(built) == 2
    loaded = sparta.load(compiled.save(tmp_path / "m"), inductor=False)
    again = {n: m for n, m in loaded.module_replacements().items() if isinstance(m, Conv2dCUDA)}
    assert sorted(again) == sorted(built)
    for name, m in again.items():
        assert m.spec == built[name].spec and m.input_names == built[name].input_names == [
            compiled.graph.op(name).input_of("input")]
        assert torch.equal(m.wp, built[name].wp) and torch.equal(m.table, built[name].table)
