"""The propagation + plan cache: a re-compile of the same model and TeSAs skips both passes."""

import torch
from models import MLP

import sparta
from sparta import TeSA, pipeline_cache


def _compile(model, tesa, x):
    return sparta.compile(model, tesa, (x,), target="cuda")  # plans only: no kernel builds needed


def test_second_compile_reads_the_cache_and_agrees(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = MLP(d_in=64, d_hidden=128, d_out=10).eval(), torch.randn(5, 64)
    mask = torch.rand(128, 64) < 0.2
    mask[:, :8] = False  # pruned input columns: propagation has something to infer
    first = _compile(model, {"fc1.weight": TeSA.from_mask(mask)}, x)
    assert "propagate" in first.timings and "plan_cache" not in first.timings
    second = _compile(model, {"fc1.weight": TeSA.from_mask(mask)}, x)
    assert "plan_cache" in second.timings and "propagate" not in second.timings
    assert second.plan.to_json() == first.plan.to_json()
    for v in first.graph.tensors():
        assert second.graph.tesa(v.name) == v.tesa, v.name
    assert second.graph.meta["propagation"].table() == first.graph.meta["propagation"].table()
    other = mask.clone()
    other[0, 20] = not other[0, 20]
    third = _compile(model, {"fc1.weight": TeSA.from_mask(other)}, x)
    assert "propagate" in third.timings, "another TeSA is another entry"


def test_corrupt_entry_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    model, x = MLP().eval(), torch.randn(3, 24)
    tesa = {"fc2.weight": TeSA.from_mask(torch.rand(48, 48) < 0.3)}
    _compile(model, tesa, x)
    entries = list(tmp_path.glob(f"*/{pipeline_cache.FILENAME}"))
    assert len(entries) == 1
    entries[0].write_bytes(b"\0" * 64)
    again = _compile(model, tesa, x)
    assert "propagate" in again.timings
    assert "plan_cache" in _compile(model, tesa, x).timings
