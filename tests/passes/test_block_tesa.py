"""TeSAs held by blocks: the same values as by elements through the lattice, the linear rule, bit rounding and the
block cover, and a compile that keeps the block form."""

import itertools

import pytest
import torch

from sparta.passes.rules.matmul import affine_rule, block_linear
from sparta.passes.transform.bitround import groupings, round_bits
from sparta.passes.transform.cover import block_cover, block_cover_by_blocks
from sparta.tesa import TeSA


def _pair(gh, gw, block, bits=16, p=0.4, seed=0):
    g = torch.rand(gh, gw, generator=torch.Generator().manual_seed(seed)) < p
    full = g.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return TeSA.from_blocks(g, block, bits), TeSA.from_mask(full, bits)


def test_from_blocks_equals_elements():
    t, full = _pair(4, 6, (2, 3))
    assert t.block_grid() is not None and t.shape == full.shape == (8, 18)
    assert t == full and full == t and t.density == full.density and t.bit_histogram() == full.bit_histogram()
    assert torch.equal(t.block_density(4, 6), full.block_density(4, 6))
    assert TeSA.from_bytes(t.to_bytes()) == t and TeSA.from_json(t.to_json()).block_grid() is not None
    assert t.meet(TeSA.dense(t.shape, 8)) == full.meet(TeSA.dense(t.shape, 8))
    assert t.meet(t).block_grid() is not None and hash(t) == hash(full)


class _Op:
    roles = ["input", "weight", "bias"]


@pytest.mark.parametrize("seed", range(40))
def test_block_linear_rule_is_exact(seed):
    gen = torch.Generator().manual_seed(seed)
    bh, bw = [(2, 2), (1, 4), (4, 2), (3, 1)][seed % 4]
    nb, kb, r = torch.randint(1, 5, (3,), generator=gen).tolist()
    w, wf = _pair(nb, kb, (bh, bw), seed=seed, p=0.5)
    if w.block_grid() is None:
        return
    x = TeSA.from_mask(torch.rand(r, kb * bw, generator=gen) < (0.3 if seed % 3 else 1.1))
    b = TeSA.from_mask(torch.rand(nb * bh, generator=gen) < 0.5) if seed % 2 else TeSA.dense((nb * bh,))
    y = TeSA.from_mask(torch.rand(r, nb * bh, generator=gen) < (0.5 if seed % 5 else 1.1))
    got = block_linear([x, w, b], [y], 0, 1, 2)
    want = affine_rule(_Op, [x, wf, b], [y], lambda a, m: torch.nn.functional.linear(a, m), [0, 1], [2])
    for p, q in zip(got[0] + got[1], want[0] + want[1]):
        assert p == q


def test_bit_rounding_keeps_blocks():
    t, full = _pair(3, 5, (4, 4), bits=5)
    assert round_bits(t, [4, 8, 16]) == round_bits(full, [4, 8, 16])
    assert round_bits(t, [4, 8, 16]).block_grid() is not None
    for a, b in zip(groupings(t, [8, 16]), groupings(full, [8, 16])):
        assert [(g.bits, g.tesa) for g in a] == [(g.bits, g.tesa) for g in b]


def test_block_cover_by_blocks_equals_element_cover():
    costs = {(64, 64): 0.02, (32, 32): 0.00817, (16, 16): 0.0148, (1, 32): 0.0228, (1, 1): 0.000577}
    for seed, p in enumerate((0.1, 0.5, 0.9)):
        grid = torch.rand(4, 3, generator=torch.Generator().manual_seed(seed)) < p
        for r in range(1, 4):
            for menu in itertools.combinations(costs, r):
                c = {s: costs[s] for s in menu}
                a = block_cover(grid.repeat_interleave(32, 0).repeat_interleave(32, 1), c)
                b = block_cover_by_blocks(grid, (32, 32), c)
                assert [(x.shape, x.n_blocks, x.nnz) for x in a] == [(x.shape, x.n_blocks, x.nnz) for x in b]
                assert all(x.elements(16) == y.elements(16) for x, y in zip(a, b))


def test_compile_keeps_weight_blocks():
    import sparta
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).eval()
    g = torch.rand(4, 2, generator=torch.Generator().manual_seed(0)) < 0.5
    g[0, 0] = True
    tesa = {"0.weight": TeSA.from_blocks(g, (32, 32))}
    x = torch.randn(8, 64)
    compiled = sparta.compile(model, tesa, (x,), target="cpu", dynamic=False)
    assert compiled.graph.tesa("0.weight").block_grid() is not None
    masked = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).eval()
    masked.load_state_dict(model.state_dict())
    with torch.no_grad():
        masked[0].weight.mul_(tesa["0.weight"].mask)
        torch.testing.assert_close(compiled(x), masked(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block, sub", [((4, 6), (2, 3)), ((4, 6), (4, 1)), ((2, 2), (2, 2))])
def test_block_density_of_blocks_finer_than_the_held_ones_equals_the_elements(block, sub):
    t, full = _pair(3, 5, block, p=0.5, seed=3)
    assert torch.equal(t.block_density(*sub), full.block_density(*sub))
    dense = TeSA.dense((7, 10), 8)                      # every element alike, ragged edge blocks
    ones = TeSA.from_mask(torch.ones(7, 10, dtype=torch.bool), 8)
    assert torch.equal(dense.block_density(*sub), ones.block_density(*sub))
    assert torch.equal(TeSA.pruned((7, 10)).block_density(*sub), torch.zeros_like(dense.block_density(*sub)))
