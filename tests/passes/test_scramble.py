import pytest
import torch
from op_cases import make_op, rand

from sparta import TeSA
from sparta.graph import TensorRef as R
from sparta.passes import scramble

A = torch.ops.aten


def test_scramble_finds_structural_zeros_and_not_relu_half_spaces():
    x = rand((6, 5))
    op, _ = make_op("relu", A.relu.default, (R("x"),), {}, {"x": x})
    mask = torch.rand(6, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    ins, outs = scramble(op, [TeSA.from_mask(mask)], [TeSA.dense((6, 5))], trials=8, seed=0)
    assert torch.equal(outs[0].mask, mask), "relu(x) < 0 half of the time must not look pruned"
    assert torch.equal(ins[0].mask, mask)


def test_scramble_backward_through_black_box_with_two_outputs():
    def box(a, b):
        return a @ b, (a * 0).sum(1)        # second output never depends on values

    a, b = rand((4, 3)), rand((3, 5))
    op, _ = make_op("box", box, (R("a"), R("b")), {}, {"a": a, "b": b})
    bmask = torch.ones(3, 5, dtype=torch.bool)
    bmask[1] = False                        # row 1 of b pruned: column 1 of a irrelevant
    need = torch.ones(4, 5, dtype=torch.bool)
    need[:, 4] = False
    ins, outs = scramble(op, [TeSA.dense((4, 3)), TeSA.from_mask(bmask)],
                         [TeSA.from_mask(need), TeSA.dense((4,))], trials=8)
    assert not ins[0].mask[:, 1].any() and ins[0].mask[:, [0, 2]].all()
    assert not ins[1].mask[:, 4].any()
    assert outs[1].density == 0.0


def test_scramble_is_deterministic_and_needs_two_trials():
    x = rand((3, 3))
    op, _ = make_op("sin", A.sin.default, (R("x"),), {}, {"x": x})
    t = TeSA.from_mask(torch.eye(3, dtype=torch.bool))
    r1 = scramble(op, [t], [TeSA.dense((3, 3))], seed=3)
    r2 = scramble(op, [t], [TeSA.dense((3, 3))], seed=3)
    assert r1[0][0] == r2[0][0] and r1[1][0] == r2[1][0]
    with pytest.raises(ValueError, match="at least 2"):
        scramble(op, [t], [TeSA.dense((3, 3))], trials=1)


def test_scramble_treats_nan_inf_as_nonzero():
    x = rand((4,))
    op, _ = make_op("reciprocal", A.reciprocal.default, (R("x"),), {}, {"x": x})
    _, outs = scramble(op, [TeSA.from_mask(torch.tensor([True, False, True, False]))], [TeSA.dense((4,))])
    assert outs[0].is_dense, "1/0 = inf is not a zero"


@pytest.mark.cuda
def test_scramble_on_cuda():
    a = rand((4, 3))
    op, _ = make_op("mm", A.mm.default, (R("a"), R("b")), {}, {"a": a, "b": rand((3, 2))})
    bm = torch.tensor([[True, False], [True, False], [True, False]])
    _, outs = scramble(op, [TeSA.dense((4, 3)), TeSA.from_mask(bm)], [TeSA.dense((4, 2))], device="cuda")
    assert torch.equal(outs[0].mask, bm[:1].expand(4, 2))


ROUTING = {
    "sort_head": lambda x: torch.sort(x, -1)[0][..., :2],
    "topk": lambda x: torch.topk(x, 2, -1).values,
    "kthvalue": lambda x: torch.kthvalue(x, 3, -1).values,
    "median": lambda x: torch.median(x, -1).values,
    "cummax_last": lambda x: torch.cummax(x, -1).values[..., -1],
    "argmax_pick": lambda x: torch.gather(x, -1, x.argmax(-1, keepdim=True)),
    "floor_gate": lambda x: x[..., :1] * torch.floor(x[..., 1:].abs().sum(-1, keepdim=True)),   # autograd-blind
}


@pytest.mark.parametrize("name", sorted(ROUTING))
def test_scramble_never_calls_a_selected_element_irrelevant(name):
    """Which element these ops read depends on the values: an element no trial selected is not irrelevant."""
    x = rand((3, 32))
    fn = ROUTING[name]
    op, outs = make_op(name, lambda a: fn(a), (R("x"),), {}, {"x": x})
    ins, _ = scramble(op, [TeSA.dense((3, 32))], [TeSA.dense(tuple(o.shape)) for o in outs], trials=16)
    assert ins[0].is_dense, f"{name}: scrambling pruned {1 - ins[0].density:.0%} of an input it selects from"


def test_scramble_leaves_ops_reading_non_constant_indices_alone():
    table, ids = rand((100, 4)), torch.randint(0, 100, (5,))
    op, _ = make_op("lookup", lambda t, i: t[i], (R("t"), R("i")), {}, {"t": table, "i": ids})
    pruned_rows = TeSA.from_mask(torch.arange(100).unsqueeze(1).expand(100, 4) >= 3)   # rows 0-2 pruned
    assert scramble(op, [pruned_rows, TeSA.dense((5,))], [TeSA.dense((5, 4))]) is None
    assert scramble(op, [pruned_rows, TeSA.dense((5,))], [TeSA.dense((5, 4))], constants={"i": ids}) is not None
