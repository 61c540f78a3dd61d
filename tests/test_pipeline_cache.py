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
    assert second.graph.propagation.table() == first.graph.propagation.table()
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


class IndexedLinear(torch.nn.Module):
    """A linear whose output features an int64 buffer selects: propagation reads the buffer's values."""

    def __init__(self, idx):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 16, bias=False)
        self.register_buffer("idx", idx)
        self.eval()

    def forward(self, x):
        return self.fc(x).index_select(1, self.idx)


def test_values_of_integer_constants_are_part_of_the_key(tmp_path, monkeypatch):
    """Two models that differ only in an index buffer: the second must not reuse the first's TeSAs."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "shared"))
    x = torch.randn(4, 16)
    mask = torch.zeros(16, 16, dtype=torch.bool)
    mask[8:] = True                                            # output features 0-7 pruned
    tesa = {"fc.weight": TeSA.from_mask(mask)}
    first = _compile(IndexedLinear(torch.arange(0, 8)), tesa, x)
    second = _compile(IndexedLinear(torch.arange(8, 16)), tesa, x)
    assert "propagate" in second.timings, "another index buffer is another entry"
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "fresh"))
    alone = _compile(IndexedLinear(torch.arange(8, 16)), tesa, x)
    for v in alone.graph.tensors():
        assert second.graph.tesa(v.name) == v.tesa, v.name
    assert second.plan.to_json() == alone.plan.to_json() and first.graph.name == second.graph.name
    keys = {pipeline_cache.pipeline_key(sparta.capture(IndexedLinear(torch.tensor(i)), (x,)), "cpu", {})
            for i in ([0, 1], [1, 0], [0, 1, 2])}
    assert len(keys) == 3


def test_a_rule_registered_by_the_user_is_part_of_the_key(tmp_path, monkeypatch):
    from sparta.passes.rules import RULES, rule
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    model, x = MLP().eval(), torch.randn(3, 24)
    _compile(model, {}, x)
    saved = RULES["relu"]

    @rule("relu")
    def relu_prunes_column_0(op, ins, outs):
        keep = torch.ones(outs[0].shape, dtype=torch.bool)
        keep[..., 0] = False
        return ins, [TeSA.from_mask(keep & outs[0].mask)]

    try:
        again = _compile(model, {}, x)
    finally:
        RULES["relu"] = saved
    assert "propagate" in again.timings, "a changed rule table must not hit the entry computed without it"
    assert again.tesa("relu").density < 1.0


def test_empty_integer_constants_hash(tmp_path):
    assert bytes(pipeline_cache.value_bytes(torch.zeros(0, dtype=torch.int64))) == b""
    assert bytes(pipeline_cache.value_bytes(torch.from_numpy(__import__("numpy").zeros((0, 3), "int64")))) == b""


def test_the_key_is_the_same_in_every_process():
    """The key hashes the rule table by bytecode: nested code objects (whose repr holds an address) included by
    content, so a new process finds the plan an earlier one stored."""
    import subprocess
    import sys
    script = ("import torch, sparta\nfrom sparta import pipeline_cache\n"
              "g = sparta.capture(torch.nn.Sequential(torch.nn.Linear(8, 8)).eval(), (torch.randn(2, 8),))\n"
              "print(pipeline_cache.pipeline_key(g, 'cpu', {}))\n")
    keys = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
            .stdout.split()[-1] for _ in range(2)}
    assert len(keys) == 1
