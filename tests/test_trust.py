"""No silent wrong answers: index-dependent models, verify() against the model as given, tied weights,
NaN at pruned positions, no aliasing of the source model; native kernels load only when asked with True."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from models import MLP

import sparta
from sparta import TeSA, VerificationError
from sparta.errors import ArgumentTypeError
from sparta.passes.rules import RULES, rule


class Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(100, 8))

    def forward(self, ids):
        return self.table[ids]


class Lookup(nn.Module):
    """A linear, then an index-dependent op on its output."""

    def __init__(self, fn):
        super().__init__()
        self.fc, self.fn = nn.Linear(16, 32), fn

    def forward(self, x, *idx):
        return self.fn(self.fc(x), *idx)


class MoE(nn.Module):
    """Mixtral-style routing: gate -> softmax -> top-2 -> gather of the chosen experts' outputs."""

    def __init__(self, experts=8, d=16):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        weights, chosen = torch.topk(torch.softmax(self.gate(x), -1), 2)
        outs = torch.stack([e(x) for e in self.experts], 1)
        picked = torch.gather(outs, 1, chosen.unsqueeze(-1).expand(-1, -1, outs.shape[-1]))
        return (picked * weights.unsqueeze(-1)).sum(1)


def x16():
    return torch.randn(4, 16)


CASES = {
    "table[ids]": (Table, lambda: (torch.randint(0, 100, (4, 5)),)),
    "gather": (lambda: Lookup(lambda y, i: torch.gather(y, 1, i)), lambda: (x16(), torch.randint(0, 32, (4, 6)))),
    "index_select": (lambda: Lookup(lambda y, i: torch.index_select(y, 1, i)),
                     lambda: (x16(), torch.randint(0, 32, (6,)))),
    "y[:, idx]": (lambda: Lookup(lambda y, i: y[:, i]), lambda: (x16(), torch.randint(0, 32, (5,)))),
    "topk": (lambda: Lookup(lambda y: torch.topk(y, 3).values), lambda: (x16(),)),
    "kthvalue": (lambda: Lookup(lambda y: torch.kthvalue(y, 5).values), lambda: (x16(),)),
    "median": (lambda: Lookup(lambda y: torch.median(y, -1).values), lambda: (x16(),)),
    "sort()[..., :2]": (lambda: Lookup(lambda y: torch.sort(y)[0][..., :2]), lambda: (x16(),)),
    "cummax": (lambda: Lookup(lambda y: torch.cummax(y, -1).values[..., -1:]), lambda: (x16(),)),
    "argmax pick": (lambda: Lookup(lambda y: torch.gather(y, 1, y.argmax(1, keepdim=True))), lambda: (x16(),)),
    "scatter_add": (lambda: Lookup(lambda y, i: torch.zeros(4, 8).scatter_add(1, i, y)),
                    lambda: (x16(), torch.randint(0, 8, (4, 32)))),
    "moe": (MoE, lambda: (x16(),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_model_with_no_tesa_and_an_index_or_selection_op_equals_eager_on_fresh_inputs(name):
    factory, inputs = CASES[name]
    torch.manual_seed(0)
    model = factory().eval()
    compiled = sparta.compile(model, {}, inputs(), verify=True)
    for v in compiled.graph.tensors("weight"):
        assert v.tesa.density == 1.0, f"{name}: propagation pruned {v.name} of a model with no TeSA"
    for _ in range(10):
        fresh = inputs()
        with torch.no_grad():
            torch.testing.assert_close(compiled(*fresh), model(*fresh))


def test_verify_checks_propagation_against_the_model_as_given(tmp_path, monkeypatch):
    """A rule that prunes what matters is caught by verify(): the reference is the model with only the
    user's TeSAs, not the graph masked by the (wrong) propagated ones."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    saved = RULES.get("gather")

    @rule("gather")
    def prunes_everything(op, ins, outs):
        return [TeSA.pruned(ins[0].shape), *ins[1:]], outs

    try:
        factory, inputs = CASES["gather"]
        with pytest.raises(VerificationError, match="only the initial TeSAs"):
            sparta.compile(factory().eval(), {}, inputs(), verify=True)
    finally:
        RULES["gather"] = saved


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("owner", ["a.weight", "b.weight"])
def test_a_tesa_on_any_owner_of_a_tied_weight_applies_to_the_shared_tensor(owner):
    model = Tied().eval()
    mask = torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) < 0.5
    x = torch.randn(3, 8)
    compiled = sparta.compile(model, {owner: TeSA.from_mask(mask)}, (x,), verify=True)
    assert compiled.tesa("a.weight") == compiled.tesa("b.weight")
    assert compiled.tesa(owner).density == pytest.approx(mask.float().mean().item())
    masked = Tied().eval()
    masked.load_state_dict(model.state_dict())
    with torch.no_grad():
        masked.a.weight.mul_(mask)
        torch.testing.assert_close(compiled(x), masked(x))
    assert "b.weight = a.weight" in compiled.report()


@pytest.mark.parametrize("density", [0.9, 0.05])   # a dense-planned and a sparse-planned linear
def test_nan_and_inf_stored_at_pruned_weights_never_reach_the_output(density):
    model = MLP().eval()
    mask = torch.rand(48, 48, generator=torch.Generator().manual_seed(1)) < density
    with torch.no_grad():
        model.fc2.weight[~mask] = float("nan")
        model.fc2.weight[~mask & (torch.arange(48) % 2 == 0)] = float("inf")
    x = torch.randn(5, 24)
    compiled = sparta.compile(model, {"fc2.weight": TeSA.from_mask(mask)}, (x,))
    out = compiled(x)
    assert torch.isfinite(out).all()
    clean = MLP().eval()
    clean.load_state_dict(model.state_dict())
    with torch.no_grad():
        clean.fc2.weight[~mask] = 0.0
        torch.testing.assert_close(out, clean(x), rtol=1e-4, atol=1e-5)


def test_the_compiled_model_does_not_alias_the_source_parameters():
    model = MLP().eval()
    x = torch.randn(5, 24)
    mask = torch.rand(48, 24) < 0.3
    compiled = sparta.compile(model, {"fc1.weight": TeSA.from_mask(mask)}, (x,))
    before = compiled(x).clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.testing.assert_close(compiled(x), before, rtol=0, atol=0)


@pytest.fixture(scope="module")
def saved_with_kernels(tmp_path_factory):
    """A saved MLP whose block-sparse linear runs a CPU kernel (a ``kernel.so`` in the folder)."""
    torch.manual_seed(0)
    mask = torch.zeros(128, 64, dtype=torch.bool)
    for i in range(8):          # 16x16 blocks touching every row and column (no channel to shrink away)
        mask[16 * i:16 * (i + 1), 16 * (i % 4):16 * (i % 4 + 1)] = True
    compiled = sparta.compile(MLP(d_in=64, d_hidden=128, d_out=10).eval(), {"fc1.weight": TeSA.from_mask(mask)},
                              (torch.randn(5, 64),))
    path = compiled.save(tmp_path_factory.mktemp("trust") / "m")
    assert list(Path(path).rglob("kernel.so"))
    return path


@pytest.mark.parametrize("trust", ["no", "False", 1, 0, None, [True]])
def test_loading_native_kernels_takes_true_or_false_only(saved_with_kernels, trust):
    with pytest.raises(ArgumentTypeError, match="trust_kernels must be True or False") as info:
        sparta.load(saved_with_kernels, trust_kernels=trust)
    assert isinstance(info.value, TypeError) and isinstance(info.value, sparta.SpartaError)
    x = torch.randn(5, 64)
    torch.testing.assert_close(sparta.load(saved_with_kernels, trust_kernels=True)(x),
                               sparta.load(saved_with_kernels, trust_kernels=False)(x), rtol=0, atol=0)
