"""The conv2d kernels on the GPU against their torch reference (``conv2d_ref``, itself checked against ``F.conv2d`` of
the masked weight on the CPU): odd channel counts, strides, padding, dilation, 1x1 and a ResNet-50 3x3, fp16 and bf16,
every epilogue, block densities 0, 0.5 and 1, batches 1 to 5 from one kernel; the module on torch's NCHW layout
(channels-last or not), inside ``torch.compile`` and a CUDA graph replayed on new inputs. Kernels are built
beforehand where TVM is (``tests/fixtures/build_cuda.py``: the ``cv_*`` fixtures)."""

import pytest
import torch
import torch.nn.functional as F

from sparta.templates.conv2d.runtime import Conv2dCUDA, folder_spec
from sparta.templates.conv2d.spec import DTYPES, conv2d_ref, expand_block_mask

from fixtures.artifacts import MISSING, ROOT

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CASES = ["cv_odd_s2_relu_res", "cv_b64_silu_bf16", "cv_5x5_dil2_nobias", "cv_1x1_s2_odd_cout",
         "cv_7x3_rect_res_bf16", "cv_r50_64_relu"]
TOL = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}


def _spec(name):
    if not (ROOT / name / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    return folder_spec(ROOT / name)


def _case(name, density, seed):
    spec = _spec(name)
    dtype = DTYPES[spec.dtype]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(spec.cout, spec.cin, spec.kh, spec.kw, generator=g) / (spec.cin * spec.kh * spec.kw) ** 0.5
    blocks = torch.rand(spec.row_blocks, spec.k_blocks, generator=g) < density
    b = torch.randn(spec.cout, generator=g) if spec.bias else None
    w = (w * expand_block_mask(blocks, spec)).to(dtype)
    module = Conv2dCUDA.from_weight(name, ROOT / name, spec, w, None if b is None else b.to(dtype)).cuda()
    return spec, dtype, w, blocks, None if b is None else b.to(dtype), module


def _inputs(spec, dtype, nb, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nb, spec.h, spec.w, spec.cin, generator=g).to(dtype).cuda()
    r = torch.randn(nb, spec.oh, spec.ow, spec.cout, generator=g).to(dtype).cuda() if spec.residual else None
    return x, r


@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", CASES)
def test_kernel_equals_the_reference(name, density):
    spec, dtype, w, blocks, b, module = _case(name, density, seed=len(name))
    assert torch.equal(module.block_mask, blocks)           # the kept blocks, and only those, are packed
    for nb in (1, 2, 5):                          # one kernel, any batch
        x, r = _inputs(spec, dtype, nb, seed=nb)
        got = module.launch([x] if r is None else [x, r])[0]
        want = conv2d_ref(x.cpu(), w, blocks, b, spec, None if r is None else r.cpu())
        assert got.shape == (nb, spec.oh, spec.ow, spec.cout) and got.dtype == dtype
        torch.testing.assert_close(got.float().cpu(), want.float(), **TOL[dtype], msg=f"{name} batch {nb}")
    if density == 0.0:              # nothing kept: act(bias + residual), no block read
        assert int(module.table[spec.row_blocks]) == 0


def test_the_module_takes_torch_layouts_compiles_and_replays_in_a_cuda_graph():
    name = "cv_odd_s2_relu_res"
    spec, dtype, w, blocks, b, module = _case(name, 0.5, seed=3)
    x, r = _inputs(spec, dtype, 3, seed=4)
    want = conv2d_ref(x.cpu(), w, blocks, b, spec, r.cpu()).permute(0, 3, 1, 2)
    nchw, res = x.permute(0, 3, 1, 2), r.permute(0, 3, 1, 2)
    for xin in (nchw, nchw.contiguous()):          # a channels-last view, then a plain NCHW tensor (copied)
        got = module(xin, res)
        assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got.float().cpu(), want.float(), **TOL[dtype])
    compiled = torch.compile(module, fullgraph=True)
    torch.testing.assert_close(compiled(nchw, res).float().cpu(), want.float(), **TOL[dtype])
    static_x, static_r = nchw.clone(), res.clone()
    module(static_x, static_r)                     # warm up (load the cubin, prepare the launch) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(static_x, static_r)
    x2, r2 = _inputs(spec, dtype, 3, seed=9)
    static_x.copy_(x2.permute(0, 3, 1, 2))
    static_r.copy_(r2.permute(0, 3, 1, 2))
    graph.replay()
    want2 = conv2d_ref(x2.cpu(), w, blocks, b, spec, r2.cpu()).permute(0, 3, 1, 2)
    torch.testing.assert_close(out.float().cpu(), want2.float(), **TOL[dtype])


def test_against_cudnn_on_a_resnet_convolution():
    spec, dtype, w, blocks, b, module = _case("cv_r50_64_relu", 1.0, seed=5)
    x = torch.randn(4, spec.cin, spec.h, spec.w, device="cuda").to(dtype).to(memory_format=torch.channels_last)
    want = F.relu(F.conv2d(x, w.cuda(), b.cuda(), spec.stride, spec.padding, spec.dilation))
    torch.testing.assert_close(module(x).float(), want.float(), **TOL[dtype])


SAVED = ROOT / "saved_conv_bottleneck"


def test_a_saved_block_sparse_bottleneck_runs_its_kernels_and_equals_the_masked_model():
    """``conv_model`` compiled for CUDA where TVM is (its 3x3 on conv2d, its 1x1s as linears on bsr_linear), loaded
    here without TVM: verified, and equal to the eager model with the masked weights."""
    if not (SAVED / "sparta.json").is_file():
        pytest.skip(MISSING + f"no saved model in {SAVED} (python tests/fixtures/cuda_specs_conv2d.py)")
    import sparta
    from fixtures.cuda_specs_conv2d import conv_model
    loaded = sparta.load(SAVED, inductor=False).to("cuda")
    kinds = sorted(type(m).__name__ for m in loaded.module_replacements().values())
    assert kinds.count("Conv2dCUDA") == 1 and kinds.count("SparseLinearCUDA") == 3, kinds
    assert max(loaded.verify(trials=2).values()) < 2e-2
    model, masks = conv_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in masks:
                p.mul_(masks[name].to(p.dtype))
    model = model.cuda()
    for nb in (1, 8, 11):
        x = torch.randn(nb, 512, 28, 28, device="cuda").half().to(memory_format=torch.channels_last)
        with torch.no_grad():
            want = model(x).float()
        got = loaded(x).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
