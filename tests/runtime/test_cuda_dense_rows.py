"""A half-pruned SwiGLU MLP compiled where TVM is (``tests/fixtures/saved_models.py``, ``save_dense_rows``), loaded
on a GPU: calls of few rows run the block-sparse GEMVs, calls from ``dense_from`` rows on run cuBLAS over a dense
copy with the gated epilogue in torch; every row count matches the masked model, also when a call replays."""

import pytest
import torch

from fixtures.artifacts import load_saved
from fixtures.kernel_choices import check_dense_rows

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _load():
    return load_saved("saved_dense_rows")


def test_every_row_count_matches_the_masked_model_on_the_kernel_its_plan_names():
    model = _load()
    mods = check_dense_rows(model)
    switch = min(m.dense_from for m in mods.values())
    reference = model.reference().to("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in sorted({1, 3, 4, 5, 17, switch - 1, switch, switch + 37, 2 * switch + 5}):
        x = torch.randn(1, rows, 1024, device="cuda", generator=g).bfloat16()
        with torch.no_grad():
            out, want = model(x), reference(x)
        out, want = (o[0] if isinstance(o, tuple) else o for o in (out, want))
        err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert out.shape == want.shape and err < 3e-2, (rows, err)
    assert all(m.dense_w is not None for m in mods.values()), "the many-row calls built the dense copies"


def test_repeated_many_row_calls_replay_the_dense_path_with_new_inputs():
    """The compiled model replays its own CUDA graph per shape: the dense copies, built at the first call, serve
    every later call of those rows."""
    model = _load()
    mods = check_dense_rows(model)
    rows = max(m.dense_from for m in mods.values()) + 3
    reference = model.reference().to("cuda")
    for seed in range(3):
        x = torch.randn(1, rows, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        with torch.no_grad():
            out, want = model(x.bfloat16()), reference(x.bfloat16())
        out, want = (o[0] if isinstance(o, tuple) else o for o in (out, want))
        err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 3e-2, (seed, err)
