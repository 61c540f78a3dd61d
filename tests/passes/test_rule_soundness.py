"""Soundness (and completeness against scrambling) of every propagation rule, on random cases.

Sound: for inputs that respect the given TeSAs (zero where pruned), every output element
the rule newly prunes is zero, and zeroing every input element the rule newly prunes
(irrelevant) leaves every still-kept output unchanged.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_cases import case_for, make_op

from sparta import TeSA
from sparta.passes import scramble
from sparta.passes.rules import RULES
from sparta.passes.rules.index import DATA_DEPENDENT, SCATTERS, SELECTIONS

# names in the rule table that are aliases with no ATen op of their own to generate cases from
NO_CASE = {"to", "conv", "gelu_", "copy", "view_copy", "permute_copy", "transpose_copy", "expand_copy",
           "unsqueeze_copy", "squeeze_copy", "alias_copy", "addbmm"}
RULE_NAMES = sorted(set(RULES) - NO_CASE)


@st.composite
def tesa_for(draw, shape, bits=(32,)):
    mode = draw(st.sampled_from(["dense", "dense", "random", "random", "slices", "pruned"]))
    b = draw(st.sampled_from(bits))
    if mode == "dense" or not shape:
        return TeSA.dense(shape, b)
    if mode == "pruned":
        return TeSA.pruned(shape)
    seed = draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    if mode == "random":
        p = draw(st.sampled_from([0.2, 0.5, 0.8]))
        return TeSA.from_mask(torch.rand(shape, generator=g) < p, b)
    dim = draw(st.integers(0, len(shape) - 1))
    keep = torch.rand(shape[dim], generator=g) < 0.6
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return TeSA.from_mask(keep.reshape(view).expand(shape), b)


def apply(x: torch.Tensor, t: TeSA) -> torch.Tensor:
    m = t.mask
    return x & m if x.dtype == torch.bool else x * m.to(x.dtype)


def check_sound(op, data, ins0, outs0, ins1, outs1):
    xs = {n: apply(data[n], t) for n, t in zip(op.inputs, ins0)}
    ys = op.call(xs)
    for i, (y, o0, o1) in enumerate(zip(ys, outs0, outs1)):
        newly = o0.mask & ~o1.mask
        assert bool((y[newly] == 0).all()), f"{op.op}: output {i} pruned where it is not zero"
    joined = {}
    for n, t in zip(op.inputs, ins1):
        joined[n] = joined[n].join(t) if n in joined else t
    ys2 = op.call({n: apply(xs[n], joined[n]) for n in xs})
    for i, (y, y2, o1) in enumerate(zip(ys, ys2, outs1)):
        m = o1.mask
        a, b = y[m], y2[m]
        if a.dtype.is_floating_point:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True), \
                f"{op.op}: output {i} changed when irrelevant inputs were zeroed"
        else:
            assert torch.equal(a, b), f"{op.op}: output {i} changed when irrelevant inputs were zeroed"


def run_case(name, draw):
    target, args, kwargs, data = draw(case_for(name))
    op, outs = make_op(name, target, args, kwargs, data)
    by_name = {n: draw(tesa_for(tuple(data[n].shape), (32, 8))) for n in dict.fromkeys(op.inputs)}
    ins0 = [by_name[n] for n in op.inputs]
    outs0 = [draw(tesa_for(tuple(o.shape))) if draw(st.booleans()) else TeSA.dense(tuple(o.shape)) for o in outs]
    return op, data, ins0, outs0


@pytest.mark.parametrize("name", RULE_NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.data())
def test_rule_is_sound(name, data):
    op, tensors, ins0, outs0 = run_case(name, data.draw)
    res = RULES[name](op, ins0, outs0)
    if res is None:
        return
    ins1, outs1 = res
    assert all(a <= b for a, b in zip(ins1, ins0)) and all(a <= b for a, b in zip(outs1, outs0))
    check_sound(op, tensors, ins0, outs0, ins1, outs1)


# value-dependent ops: their rules assume any element may be selected (an all-zero row's argmax is 0, which
# scrambling sees and the rule does not claim)
DATA_MOVED = set(SELECTIONS + SCATTERS + DATA_DEPENDENT)
# rules are exact where scrambling is: on these they must find every zero scrambling finds
COMPLETE_FORWARD = [n for n in RULE_NAMES if n not in {"hardtanh", "clamp", "clamp_min", "clamp_max", "relu6",
                                                       "round", "trunc", "floor", "ceil", "sign", "remainder",
                                                       "fmod", "floor_divide", "where", "masked_fill", "lerp",
                                                       "addcmul", "lt", "gt", "le", "ge", "eq", "ne", "maximum",
                                                       "minimum", "fmax", "fmin", "logical_and", "logical_or",
                                                       "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
                                                       "bitwise_not", "any", "all", "max", "min", "amax", "amin",
                                                       "max_pool1d", "max_pool2d", "adaptive_max_pool1d",
                                                       "adaptive_max_pool2d", "nan_to_num", "copy", "div", "mul",
                                                       "prod", "gelu", "rsub", "sub", "addcdiv", "logical_not",
                                                       # integer indices are data: scrambling's draws are narrower
                                                       "embedding"} | DATA_MOVED]


@pytest.mark.parametrize("name", COMPLETE_FORWARD)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.data())
def test_rule_finds_what_scrambling_finds(name, data):
    op, tensors, ins0, outs0 = run_case(name, data.draw)
    res = RULES[name](op, ins0, outs0)
    scr = scramble(op, ins0, outs0, trials=12, seed=1)
    if res is None or scr is None:
        return
    for got, found in zip(res[1], scr[1]):
        assert bool((~found.mask <= ~got.mask).all()), f"{name}: scrambling found zeros the rule missed"


def test_linear_rule_over_distinct_rows_equals_the_full_product():
    """The linear rule groups repeated row patterns; its answer must not change."""
    from sparta.graph import Op
    from sparta.passes.rules.matmul import affine_rule, linear
    g = torch.Generator().manual_seed(5)
    patterns = torch.rand(3, 40, generator=g) < 0.6
    x_mask = patterns[torch.randint(0, 3, (2, 30), generator=g)]           # 60 rows, 3 patterns
    y_mask = torch.rand(4, 50, generator=g) < 0.7
    y_mask = y_mask[torch.randint(0, 4, (2, 30), generator=g)]
    ins = [TeSA.from_mask(x_mask), TeSA.from_mask(torch.rand(50, 40, generator=g) < 0.2),
           TeSA.from_mask(torch.rand(50, generator=g) < 0.5)]
    outs = [TeSA.from_mask(y_mask)]
    op = Op("lin", "linear", ["x", "w", "b"], ["y"], roles=["input", "weight", "bias"])
    fast_ins, fast_outs = linear(op, ins, outs)
    full_ins, full_outs = affine_rule(op, ins, outs, torch.nn.functional.linear, [0, 1], [2])
    assert all(a == b for a, b in zip(fast_ins + fast_outs, full_ins + full_outs))
    assert fast_outs[0] != outs[0] or fast_ins[1] != ins[1], "the case exercises a real refinement"
