"""Kept blocks from the plan's block covers and packing from the weight's own dtype (codegen/kept_blocks.py): the same
masks and packed blocks as the dense path; stacked sibling weights are concatenated only when read, one at a time."""

import shutil
import weakref
from types import SimpleNamespace

import pytest
import torch

import sparta
from sparta.codegen.kept_blocks import KeepGrid, keep_grid, kept_block_mask, packed_blocks
from sparta.graph import Value
from sparta.stacked_value import StackedValue
from sparta.templates.bsr_linear.packing import block_mask_of, build_table, pack_weight
from sparta.templates.bsr_linear.spec import BsrSpec, gate_padded


def _case(n, k, block, density, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    grid = torch.rand(n // block[0], k // block[1], generator=g) < density
    w = torch.randn(n, k, generator=g).to(dtype)
    w[: block[0], : block[1]] = 0                           # a kept block of zeros (where kept) is not kept
    w[block[0]: 2 * block[0], : block[1] // 2] = 0          # a partly zero one is
    grid[0, 0] = grid[1, 0] = True
    return w, grid


@pytest.mark.parametrize("n, k, block, bn, bk, gate", [(256, 128, (32, 32), 32, 32, False),
                                                       (256, 128, (32, 32), 64, 64, False),
                                                       (192, 160, (16, 32), 32, 64, False),
                                                       (160, 96, (16, 16), 32, 32, True),     # halves padded to bn
                                                       (256, 128, (32, 32), 64, 32, True)])
@pytest.mark.parametrize("stacked", [False, True])
def test_kept_blocks_and_packing_match_the_masked_fp32_weight(n, k, block, bn, bk, gate, stacked):
    w, grid = _case(n, k, block, 0.3, n + k)
    keep = KeepGrid(grid, block, n, k)
    dense = torch.where(grid.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1), w.float(), 0.0)
    half = n // 2 if gate else 0
    value = StackedValue("w", sparta.TeSA.dense((n, k), 16), [w[: n // 2], w[n // 2:]]) if stacked else \
        Value("w", (n, k), w.dtype, "weight", sparta.TeSA.dense((n, k), 16), w)
    want = block_mask_of(gate_padded(dense, half, bn) if gate else dense, bn, bk)
    mask = kept_block_mask(value, keep, bn, bk, half)
    assert torch.equal(mask, want)
    spec = BsrSpec(0, half or n, k, bn=bn, bk=bk, tm=64, warps_m=2, gate=gate, dtype="bfloat16")
    wp, table = pack_weight(dense.to(torch.bfloat16), spec, mask)
    got_table, packed = build_table(mask, spec.groups, spec.gate)
    assert torch.equal(got_table, table)
    assert torch.equal(packed_blocks(value, keep, spec, packed, torch.bfloat16), wp)


def test_keep_grid_reads_block_covers_and_declines_others():
    tesa = sparta.TeSA.from_blocks(torch.rand(4, 3) < 0.5, (32, 32), bits=16)
    plan = SimpleNamespace(subops=[SimpleNamespace(elements=tesa)])
    grid = keep_grid(SimpleNamespace(op="linear"), plan, 128, 96)
    assert grid.block == (32, 32) and torch.equal(grid.grid, tesa.block_grid()[0] != 0)
    assert keep_grid(SimpleNamespace(op="matmul"), plan, 128, 96) is None
    fine = SimpleNamespace(subops=[SimpleNamespace(elements=sparta.TeSA.from_mask(torch.rand(128, 96) < 0.5))])
    assert keep_grid(SimpleNamespace(op="linear"), fine, 128, 96) is None
    assert keep_grid(SimpleNamespace(op="linear"), SimpleNamespace(subops=[SimpleNamespace(elements=None)]),
                     128, 96).all()


def test_a_stacked_value_is_its_parts_concatenated_and_holds_nothing_else():
    parts = [torch.randn(4, 3), torch.randn(2, 3)]
    v = StackedValue("a+b.weight", sparta.TeSA.dense((6, 3)), parts)
    assert v.shape == (6, 3) and v.has_data and torch.equal(v.data, torch.cat(parts))
    assert v.data is not v.data, "concatenated on each read, never held"
    assert v.rows(4, 6) is parts[1] or torch.equal(v.rows(4, 6), parts[1])
    assert v.rows(4, 6).data_ptr() == parts[1].data_ptr()
    copy = v.copy()
    assert isinstance(copy, StackedValue) and copy.parts[0] is parts[0]
    assert "data" not in vars(v)


class Blocks(torch.nn.Module):
    """Two pre-norm-free decoder-like blocks: q/k/v and gate/up siblings."""

    def __init__(self, d=256, h=512, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            q=torch.nn.Linear(d, d, bias=False), k=torch.nn.Linear(d, d, bias=False),
            v=torch.nn.Linear(d, d, bias=False), gate=torch.nn.Linear(d, h, bias=False),
            up=torch.nn.Linear(d, h, bias=False), down=torch.nn.Linear(h, d, bias=False))) for _ in range(layers))

    def forward(self, x):
        for m in self.layers:
            x = x + m["q"](x) * m["k"](x) + m["v"](x)
            x = x + m["down"](torch.nn.functional.silu(m["gate"](x)) * m["up"](x))
        return x


def _snapshot(compiled):
    out = {"plan": compiled.plan_report()}
    for name, m in sorted(compiled.module_replacements().items()):
        out[name] = (repr(getattr(m, "spec", None)), {k: b.clone() for k, b in m.named_buffers()})
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_cuda_compile_reads_one_stacked_weight_at_a_time_and_packs_as_the_dense_path(tmp_path, monkeypatch):
    """At most one stacked weight is ever concatenated at once, and the plan, kernels and packed weights are those of
    the fp32 masked-copy path."""
    pytest.importorskip("tvm")
    from sparta.codegen import select_cuda
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = Blocks().bfloat16().eval()
    g = torch.Generator().manual_seed(1)
    tesa = {n: sparta.TeSA.from_blocks(torch.rand(p.shape[0] // 32, p.shape[1] // 32, generator=g) < 0.2,
                                       (32, 32), bits=16) for n, p in model.named_parameters()}
    x = torch.randn(1, 16, 256).bfloat16()
    live, peak = [0], [0]
    read = StackedValue.data.fget

    def counted(self):
        t = read(self)
        if t.dim() == 2 and len(self.parts) > 1:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            weakref.finalize(t, lambda: live.__setitem__(0, live[0] - 1))
        return t

    monkeypatch.setattr(StackedValue, "data", property(counted, StackedValue.data.fset))
    fast = _snapshot(sparta.compile(model, tesa, (x,), target="cuda"))
    assert peak[0] <= 1
    monkeypatch.setattr(select_cuda.GemmSite, "fast", lambda self, *a: False)
    slow = _snapshot(sparta.compile(model, tesa, (x,), target="cuda"))
    assert fast["plan"] == slow["plan"] and fast.keys() == slow.keys()
    for name in fast.keys() - {"plan"}:
        assert fast[name][0] == slow[name][0]
        assert fast[name][1].keys() == slow[name][1].keys()
        for b in fast[name][1]:
            assert torch.equal(fast[name][1][b], slow[name][1][b]), (name, b)


def test_the_dense_reference_masks_weights_as_they_are_read():
    """A compiled model holds no masked copy of its weights: each is masked when the reference reads it."""
    from sparta.compiled_model import MaskedWeights, masked_weights
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
    keep = torch.rand(64, 64) < 0.5
    compiled = sparta.compile(model, {"0.weight": keep}, (torch.randn(4, 64),))
    masked = masked_weights(compiled.graph)
    assert isinstance(masked, MaskedWeights) and list(masked) == ["0.weight"]
    assert not any(isinstance(v, torch.Tensor) for v in vars(masked).values())
    assert torch.equal(masked["0.weight"], model[0].weight * keep)
    assert masked["0.weight"] is not masked["0.weight"]
    with pytest.raises(KeyError):
        masked["2.weight"]
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = model[2](torch.relu(x @ (model[0].weight * keep).t() + model[0].bias))
        got = compiled.reference()(x)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, want)
