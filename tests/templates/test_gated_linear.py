"""Gated linear units (``act(gate) · up``) as one block-sparse linear: the packing of the gate's and the up's blocks
per slot, the reference, the graph pattern the CUDA epilogue takes, and a gated model compiled for CUDA here
(kernels built, no GPU: fake tensors, export, save and load)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import sparta
from sparta.passes.fusion import gated_unit
from sparta.templates.bsr_linear.packing import block_mask_for, pack_weight, table_parts, unpack_weight
from sparta.templates.bsr_linear.spec import BsrSpec, gate_padded, reference


def _spec(n=88, k=72, **kw):
    return BsrSpec(0, n, k, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="silu", gate=True, **kw)


@pytest.mark.parametrize("density", [0.0, 0.4, 1.0])
def test_a_slot_packs_its_gate_blocks_then_its_up_blocks(density):
    torch.manual_seed(0)
    spec = _spec()
    w = torch.randn(2 * spec.n, spec.k).half()
    mask = torch.rand(spec.weight_row_blocks, spec.k_blocks) < density
    wp, table = pack_weight(w, spec, mask)
    slots, kidx = table_parts(table, spec)
    assert spec.table_head == 4 * spec.row_blocks and len(slots) == spec.row_blocks
    rows = spec.row_blocks
    for row, first, count, gate in slots:
        assert count == int(mask[row].sum() + mask[rows + row].sum()) and gate == int(mask[row].sum())
        assert kidx[first:first + gate] == torch.nonzero(mask[row]).flatten().tolist()
        assert kidx[first + gate:first + count] == torch.nonzero(mask[rows + row]).flatten().tolist()
    totals = [s[2] for s in slots]
    assert totals == sorted(totals, reverse=True), "heaviest slots first"
    keep = mask.repeat_interleave(32, 0).repeat_interleave(32, 1)[:, : spec.k]
    want = torch.cat([(gate_padded(w, spec.n, 32) * keep)[:spec.n], (gate_padded(w, spec.n, 32) * keep)[96:96 + 88]])
    assert torch.equal(unpack_weight(wp, table, spec), want)
    assert torch.equal(block_mask_for(unpack_weight(wp, table, spec), spec), mask)


def test_the_reference_is_act_of_the_gate_times_the_up():
    torch.manual_seed(1)
    spec = _spec()
    x, w, b = torch.randn(5, spec.k).half(), torch.randn(2 * spec.n, spec.k).half(), torch.randn(2 * spec.n).half()
    mask = torch.rand(spec.weight_row_blocks, spec.k_blocks) < 0.5
    keep = gate_padded(torch.ones(2 * spec.n, spec.k), spec.n, 32) * \
        mask.repeat_interleave(32, 0).repeat_interleave(32, 1)[:, : spec.k]
    keep = torch.cat([keep[:spec.n], keep[96:96 + spec.n]])
    y = x.float() @ (w.float() * keep).t() + b.float()
    want = torch.nn.functional.silu(y[:, :spec.n]) * y[:, spec.n:]
    torch.testing.assert_close(reference(x, w, mask, b, "silu", 32, 32, gate=True).float(), want.half().float())
    with pytest.raises(ValueError, match="gate"):
        _spec(dtype="int8")
    with pytest.raises(ValueError, match="gate"):
        BsrSpec(0, 64, 64, bn=32, bk=32, tm=64, warps_m=2, groups=2, gate=True)


class Gated(torch.nn.Module):
    def __init__(self, d=64, h=96, act=torch.nn.functional.silu, leak=False):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
        self.down, self.act, self.leak = torch.nn.Linear(h, d, bias=False), act, leak

    def forward(self, x):
        g = self.gate(x)
        y = self.down(self.act(g) * self.up(x))
        return y + g.sum() if self.leak else y


@pytest.mark.parametrize("act, leak, found", [(torch.nn.functional.silu, False, "silu"),
                                              (torch.nn.functional.gelu, False, "gelu"),
                                              (torch.tanh, False, None),            # no CUDA epilogue computes it
                                              (torch.nn.functional.silu, True, None)])  # the gate is read elsewhere
def test_the_gated_pattern_is_found_only_where_the_epilogue_can_own_it(act, leak, found):
    from sparta.passes.simplify import fuse_sibling_linears
    graph = fuse_sibling_linears(sparta.capture(Gated(act=act, leak=leak).eval(), (torch.randn(2, 5, 64),)))
    stacked = next(op for op in graph.ops("linear") if graph.tensor(op.input_of("weight")).shape == (192, 64))
    unit = gated_unit(graph, stacked.outputs[0], "cuda")
    assert (unit.activation if unit else None) == found
    assert gated_unit(graph, stacked.outputs[0], "cpu") is None
    if unit is not None:
        assert [o.op for o in unit.ops][2:] == [act.__name__ if act.__name__ != "tanh" else "tanh", "mul"]


def _block_mask(n, k, density, seed):
    g = torch.Generator().manual_seed(seed)
    grid = torch.rand(n // 32, k // 32, generator=g) < density
    grid[0, 0] = True
    return grid.repeat_interleave(32, 0).repeat_interleave(32, 1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_gated_mlp_compiled_for_cuda_writes_the_product_in_the_gate_up_kernel(tmp_path, monkeypatch):
    """gate/up stacked, the slices, SiLU and product fused into its epilogue: the plan says so, one kernel module
    writes the product's tensor (the fx graph has no slice, silu or mul), fake CUDA tensors propagate through it,
    torch.export traces it, and a saved model loads with the same gated kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    pytest.importorskip("tvm")
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = Gated(1024, 2816).bfloat16().eval()
    tesa = {f"{n}.weight": _block_mask(*getattr(model, n).weight.shape, 0.1, i)
            for i, n in enumerate(("gate", "up", "down"))}
    x = torch.randn(2, 128, 1024).bfloat16()
    compiled = sparta.compile(model, tesa, (x,), target="cuda")
    report = compiled.plan_report()
    assert "+swiglu" in report and "computed by linear's epilogue (swiglu)" in report
    gated = [m for m in compiled.module_replacements().values() if getattr(getattr(m, "spec", None), "gate", False)]
    assert len(gated) == 1 and gated[0].spec.n == 2816 and gated[0].spec.act == "silu"
    assert gated[0].gemv is not None and gated[0].gemv[1].gate and all(b.gate for _, _, b in gated[0].buckets)
    (mul,) = compiled.graph.ops("mul")
    assert gated[0].output_names == [mul.outputs[0]]
    code = compiled.module.code
    assert "kernel_silu" not in code and "slice" not in code and "mul" not in code, code
    with FakeTensorMode():
        state = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda")
                 for k, v in [*compiled.module.named_parameters(), *compiled.module.named_buffers()]}
        (out,) = torch.func.functional_call(compiled.module, state, (torch.empty(3, 7, 1024, device="cuda",
                                                                                 dtype=torch.bfloat16),))
        assert out.shape == (3, 7, 1024) and out.dtype == torch.bfloat16
    ep = torch.export.export(compiled, (x,))
    assert sum("sparta.bsr_linear" in str(n.target) for n in ep.graph.nodes if n.op == "call_function") == 2
    path = Path(compiled.save(tmp_path / "m"))
    config = json.loads((path / "sparta.json").read_text())
    assert any("gated_output" in json.dumps(v) for v in config.values())
    loaded = sparta.load(path)
    again = [m for m in loaded.module_replacements().values() if getattr(getattr(m, "spec", None), "gate", False)]
    assert len(again) == 1 and again[0].output_names == gated[0].output_names
    torch.testing.assert_close(again[0].dense_weight(), gated[0].dense_weight(), rtol=0, atol=0)
    stacked = compiled.graph.tensor("gate+up.weight")         # the TeSAs propagated from down's pruned columns
    assert torch.equal(stacked.data, torch.cat([model.gate.weight, model.up.weight]).detach())
    torch.testing.assert_close(again[0].dense_weight(), compiled.graph.tesa(stacked.name).apply(stacked.data),
                               rtol=0, atol=0)
