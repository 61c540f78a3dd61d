"""bf16 models with low-bit linears, compiled and saved where TVM is (``tests/fixtures/saved_models.py``,
``save_bf16_low_bits``), loaded and run on a GPU: W8A8 (per-token quantiser, int8 tile kernels) and W4A16 (block
kernel, GEMV) read and write bf16 with no cast to fp16 around them, and match the model's reference."""


import pytest
import torch

from fixtures.artifacts import load_saved
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name, kind", [("saved_mlp_bf16_w8a8", "int8"), ("saved_mlp_bf16_w4a16", "w4a16")])
def test_a_bf16_low_bit_model_runs_bf16_kernels_and_verifies(name, kind):
    from sparta.runtime.cuda import act16_dtype
    model = load_saved(name)
    mods = [m for m in model.module_replacements().values() if hasattr(m, "dense_weight")]
    assert mods and all(act16_dtype(m.spec) == torch.bfloat16 for m in mods if getattr(m.spec, "out", "") != "int8")
    assert any(getattr(m.spec, "dtype", "") == kind for m in mods)
    assert max(model.verify(trials=2).values()) < 5e-2
    shapes = [(3, 333, 1024), (1, 5, 1024), (2, 64, 1024)] if kind == "int8" else [(2, 8, 1024)]
    reference = model.reference().to("cuda")
    for shape in shapes:
        x = torch.randn(*shape, device="cuda").bfloat16()
        with torch.no_grad():
            out, want = model(x), reference(x)
        out, want = (o[0] if isinstance(o, tuple) else o for o in (out, want))
        assert out.dtype == torch.bfloat16 and out.shape == shape
        err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 5e-2, (shape, err)
