"""TeSAs whose elements are all alike (``TeSA.dense``): the linear rule, bit rounding, sibling stacking and the
plan's candidates on them give what the same TeSA held by elements gives, and they stay uniform."""

import pytest
import torch

from sparta.passes.rules.matmul import affine_rule, linear
from sparta.passes.simplify import _stacked_tesa
from sparta.passes.transform.bitround import BitGroup, groupings, round_bits
from sparta.passes.transform.profile import load_profile
from sparta.passes.transform.transform_op import _group_options
from sparta.tesa import TeSA


def _by_elements(t: TeSA) -> TeSA:
    return TeSA(t.view().contiguous().clone(), _trusted=True)


class _Op:
    roles = ["input", "weight", "bias"]


@pytest.mark.parametrize("seed", range(12))
def test_linear_rule_on_a_uniform_weight_is_exact(seed):
    gen = torch.Generator().manual_seed(seed)
    n, k, r = torch.randint(1, 9, (3,), generator=gen).tolist()
    w = TeSA.dense((n, k), [4, 8, 16][seed % 3])
    x = TeSA.from_mask(torch.rand(r, k, generator=gen) < (0.3 if seed % 3 else 1.1))
    b = TeSA.from_mask(torch.rand(n, generator=gen) < 0.5) if seed % 2 else TeSA.dense((n,))
    y = TeSA.from_mask(torch.rand(r, n, generator=gen) < (0.5 if seed % 5 else 1.1))
    got = linear(_Op, [x, w, b], [y])
    want = affine_rule(_Op, [x, _by_elements(w), b], [y], lambda a, m: torch.nn.functional.linear(a, m), [0, 1], [2])
    for p, q in zip(got[0] + got[1], want[0] + want[1]):
        assert p == q


def test_bit_rounding_and_stacking_keep_uniform():
    t = TeSA.dense((64, 96), 5)
    rounded = round_bits(t, [4, 8, 16])
    assert rounded.uniform == 8 and rounded == round_bits(_by_elements(t), [4, 8, 16])
    for a, b in zip(groupings(t, [8, 16]), groupings(_by_elements(t), [8, 16])):
        assert [(g.bits, g.tesa) for g in a] == [(g.bits, g.tesa) for g in b]
        assert all(g.tesa.uniform is not None for g in a)
    stacked = _stacked_tesa([TeSA.dense((32, 96), 4), TeSA.dense((64, 96), 4)])
    assert stacked.uniform == 4 and stacked.shape == (96, 96)
    assert _stacked_tesa([TeSA.dense((32, 96), 4), TeSA.dense((32, 96), 8)]).uniform is None


@pytest.mark.parametrize("shape", [(256, 384), (200, 96), (96, 1000), (33, 70)])
@pytest.mark.parametrize("target,bits,act", [("cuda", 4, 16), ("cuda", 16, 16), ("cpu", 8, 8), ("cpu", 32, 32)])
def test_plan_options_of_a_uniform_group_equal_its_elements(shape, target, bits, act):
    prof = load_profile(target)
    t = TeSA.dense(shape, bits)
    rows = [32, 1, 4, 16, 64, 256, 512]
    got = _group_options(BitGroup(bits, t), prof, act, rows, (16, 16))
    want = _group_options(BitGroup(bits, _by_elements(t)), prof, act, rows, (16, 16))
    assert [(c, d) for c, _, d in got] == [(c, d) for c, _, d in want]
    for (_, a, _), (_, b, _) in zip(got, want):
        assert [(s.template, s.block, s.n_blocks, s.nnz, s.est_us, s.blocks) for s in a] == \
            [(s.template, s.block, s.n_blocks, s.nnz, s.est_us, s.blocks) for s in b]
        assert all(s.elements == q.elements for s, q in zip(a, b))
