"""A 4-bit MLP compiled over 1-2048 tokens (``tests/fixtures/cuda_specs_w4a16_dequant.py``) on the CPU machine: its
many-row calls dequantise the W4A16 GEMVs' codes per call (no copy kept) to exactly the weight the GEMVs apply, a
save and a load keep the dequantisation kernel and its switch, and a kernels-only save loaded with the model's
weights packs the same codes again."""

import shutil

import pytest
import torch

from fixtures.cuda_specs_w4a16_dequant import w4_prefill_mlp
from fixtures.kernel_choices import check_w4_prefill

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]


@pytest.fixture(scope="module")
def model():
    return w4_prefill_mlp()


def test_many_rows_apply_the_gemvs_weight_without_keeping_a_copy(model):
    from sparta.templates.w4a16_gemv.spec import dequantize
    for m in check_w4_prefill(model).values():
        w = dequantize(*m.w4_pack(), m.dequant[1].gemv)
        assert torch.equal(m.dequant_reference(), w.to(torch.bfloat16))
        assert torch.equal(w.to(torch.bfloat16), m.dense_weight().to(torch.bfloat16)), "the tile's weight too"
        x = torch.randn(m.dense_from + 1, m.spec.k).bfloat16()
        torch.testing.assert_close(m.dense_rows_call(x).float(), x.float() @ w.T, rtol=2e-2, atol=2e-2)
        assert m.dense_rows_call(x[:m.dense_from - 1]) is None and m.dense_w is None


def test_save_and_load_keep_the_dequantisation_and_a_checkpoint_packs_again(model, tmp_path):
    import sparta
    model.save(tmp_path / "full")
    loaded = check_w4_prefill(sparta.load(tmp_path / "full"))
    for name, m in check_w4_prefill(model).items():
        other = loaded[name]
        assert other.dequant[1] == m.dequant[1] and other.dense_from == m.dense_from
        assert torch.equal(other.wp, m.wp) and "weight dequantised per call" in repr(other)
    model.save(tmp_path / "kernels", weights=False)
    again = check_w4_prefill(sparta.load(tmp_path / "kernels", weights=model.source_reference().state_dict()))
    for name, m in again.items():
        assert torch.equal(m.wp, loaded[name].wp)
