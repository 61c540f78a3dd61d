"""A 2:4 SwiGLU MLP compiled where TVM is (``tests/fixtures/saved_models.py``, ``save_nm_mlp``), loaded on a GPU:
calls of up to 8 rows run the 8-row 2:4 kernel, up to 16 the 16-row one, more rows cuBLAS over a dense copy; every row
count matches the masked model, also when a call replays."""

import pytest
import torch

from fixtures.artifacts import load_saved
from fixtures.kernel_choices import check_nm_mlp

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_every_row_count_matches_the_masked_model_on_the_kernel_its_plan_names():
    model = load_saved("saved_nm_mlp")
    mods = check_nm_mlp(model)
    reference = model.reference().to("cuda")
    for rows in (1, 3, 8, 9, 16, 17, 40, 8, 1, 200, 9, 16):
        x = torch.randn(1, rows, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
        with torch.no_grad():
            out, want = model(x.bfloat16()), reference(x.bfloat16())
        out, want = (o[0] if isinstance(o, tuple) else o for o in (out, want))
        err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert out.shape == want.shape and err < 3e-2, (rows, err)
    assert all(m.dense_w is not None for m in mods.values()), "calls of 17+ rows built the dense copies"
