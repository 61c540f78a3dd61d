"""An MLP of 8-bit weights compiled where TVM is (``tests/fixtures/saved_models.py``, ``save_fp8_mlp``), loaded on a
GPU: calls of few rows run the FP8 GEMV (E4M3 weights), more rows cuBLAS over the weights dequantised at each call;
every row count matches the model with the weights the kernels apply, each kernel module replays in a CUDA graph, and a
kernels-only save packs a checkpoint's weights again on the GPU."""

import pytest
import torch

from fixtures.artifacts import load_saved
from fixtures.kernel_choices import check_fp8_mlp

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _load():
    return load_saved("saved_fp8_mlp")


def _err(out, want) -> float:
    out, want = (o[0] if isinstance(o, tuple) else o for o in (out, want))
    assert out.shape == want.shape
    return ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()


def test_every_row_count_matches_the_dequantised_model_on_the_kernel_its_plan_names():
    model = _load()
    mods = check_fp8_mlp(model)
    reference = model.reference().to("cuda")
    for rows in (1, 3, 16, 17, 40, 5, 1, 200, 9, 2048):
        x = torch.randn(1, rows, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
        with torch.no_grad():
            err = _err(model(x.bfloat16()), reference(x.bfloat16()))
        assert err < 2e-2, (rows, err)
    assert all(m.dense_w is None for m in mods.values()), "no dense copy kept: the weight is dequantised per call"


def test_each_kernel_module_replays_in_a_cuda_graph_on_new_inputs():
    from sparta.templates.epilogue_ref import activate
    model = _load()
    for m in check_fp8_mlp(model).values():
        x = torch.randn(3, m.spec.k, device="cuda").bfloat16()
        w = m.dense_weight().cuda()
        with torch.no_grad():
            m(x)                                             # warm: kernel loaded, launch prepared
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = m(x)
            for seed in range(3):
                g = torch.Generator(device="cuda").manual_seed(seed)
                x.copy_(torch.randn(3, m.spec.k, device="cuda", generator=g))
                graph.replay()
                y = x.float() @ w.T + (m.bias.float() if m.bias is not None else 0)
                err = _err(out, activate(y, m.spec.act))
                assert err < 2e-2, (m.op_name, seed, err)


def test_a_kernels_only_save_packs_the_checkpoint_again_on_the_gpu(tmp_path):
    import sparta
    model = _load()
    state = {k: v.to("cuda") for k, v in model.source_reference().state_dict().items()}  # the user's names
    model.save(tmp_path / "kernels", weights=False)
    again = sparta.load(tmp_path / "kernels", weights=state).to("cuda")
    assert all(m.codes.is_cuda for m in check_fp8_mlp(again).values()), "packed on the checkpoint's GPU"
    x = torch.randn(1, 4, 1024, device="cuda").bfloat16()
    with torch.no_grad():
        err = _err(again(x), model(x))
    assert err < 2e-2, err
