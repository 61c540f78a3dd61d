"""Kernels built for any number of rows (``m=0``: ``M`` a kernel argument, the grid computed from it at launch),
the few-row block-sparse GEMV over the tile kernels' packed blocks and the bf16 kernels, on a GPU, against their torch
references (bf16 kernels against the reference computed from the same bf16 operands, rounded to bf16).

Fixtures ``r_*`` of ``tests/fixtures/cuda_specs.py`` (``python tests/fixtures/build_cuda.py --only ...``). One
prepared launch is called at several row counts in turn, as a dynamic model calls it; fresh random data each run,
outputs poisoned with NaN first.
"""

import json

import pytest
import torch

from fixtures.artifacts import MISSING, ROOT
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROWS = (1, 7, 64, 200, 3, 257)             # one op, called in this order: grids grow and shrink
LINEARS = ["r_odd_gelu", "r_odd_gelu_tm32", "r_stream_ragged_relu", "r_i8_odd_relu_q8", "r_w4_ragged_zero_relu",
           "r_wg_b64", "r_bf16_odd_gelu", "r_bf16_stream_ragged_relu", "r_i8_bf16_odd_gelu",
           "r_w4_bf16_ragged_zero_relu", "r_w4g_ragged_zero_g32_relu", "r_w4g_bf16_g128_nobias"]
GEMVS = ["r_gemv_odd_gelu", "r_gemv_stream_ragged_relu", "r_gemv_b64_gelu_w8", "r_gemv_b16_nobias_m5",
         "r_gemv_k128_m8_w16", "r_gemv_square_pdl", "r_gemv_bf16_odd_gelu", "r_gemv_bf16_b64_nobias",
         "r_gemv_l1_i4_bf16_ragged", "r_gemv_l2_i1_m1_pdl"]


def _folder(name):
    folder = ROOT / name
    if not (folder / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    return folder


def _err(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1.0)).item()


@pytest.mark.parametrize("name", LINEARS)
def test_tile_kernels_take_any_number_of_rows(name):
    from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec
    from sparta.runtime.cuda import act16_dtype
    from sparta.templates.bsr_linear.int4_records import unpack_w4
    from sparta.templates.bsr_linear.spec import reference, reference_int8
    from sparta.templates.epilogue_ref import requantize
    from sparta.templates.quant.spec import quantize_rows
    folder = _folder(name)
    spec = load_spec(folder)
    assert spec.m == 0 and json.loads((folder / "launch.json").read_text())["grid"][0] == ["M", spec.tm]
    if spec.mma == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    act = act16_dtype(spec)
    mask = torch.rand(spec.row_blocks, spec.k_blocks) < 0.4
    if spec.gemv_group:                # the GEMVs' pack is dense
        mask = torch.ones_like(mask)
    w = torch.randn(spec.n, spec.k, device="cuda").to(act)
    bias = torch.randn(spec.n, device="cuda").to(act) if spec.bias else None
    scale = 0.05 if spec.out == "int8" else None
    op = BsrLinearOp(folder, spec, w, mask, bias, group=64, out_scale=scale)
    for m in ROWS:
        x = torch.randn(m, spec.k, device="cuda").to(act)
        out = torch.full((m, spec.n), -128 if scale else float("nan"), device="cuda",
                         dtype=torch.int8 if scale else act)
        op(x, out=out)
        if spec.dtype == "int8":
            y = reference_int8(*quantize_rows(x), *quantize_rows(w), mask, bias, spec.act, spec.bn, spec.bk,
                               dtype=act)
        elif spec.dtype == "w4a16":
            y = reference(x, unpack_w4(op.wp, op.table, spec), None, bias, spec.act, spec.bn, spec.bk)
        else:
            y = reference(x, w, mask, bias, spec.act, spec.bn, spec.bk)
        torch.cuda.synchronize()
        if scale:
            assert (out.int() - requantize(y.float(), scale).int()).abs().max() <= 1, f"{name} at M={m}"
        else:
            assert out.dtype == y.dtype and not out.isnan().any() and _err(out, y) < (1e-2 if act == torch.bfloat16
                                                                                   else 2e-3), f"{name} at M={m}"


@pytest.mark.parametrize("density", [0.0, 0.35, 1.0])
@pytest.mark.parametrize("name", GEMVS)
def test_gemv_matches_the_reference_over_the_tile_kernels_packing(name, density):
    from sparta.templates.bsr_linear.runtime import BsrGemvOp
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.packing import pack_weight
    from sparta.templates.bsr_linear.spec import BsrSpec, reference
    folder = _folder(name)
    spec = BsrGemvSpec(**json.loads((folder / "spec.json").read_text()))
    tile = BsrSpec(0, spec.n, spec.k, bn=spec.bn, bk=spec.bk, tm=64, warps_m=1 if spec.bn < 32 else 2,
                   groups=spec.groups, bias=spec.bias, act=spec.act, dtype=spec.dtype)
    act = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16
    mask = torch.rand(tile.row_blocks, tile.k_blocks) < density
    w = torch.randn(spec.n, spec.k, device="cuda").to(act)
    bias = torch.randn(spec.n, device="cuda").to(act) if spec.bias else torch.zeros(spec.n, device="cuda").to(act)
    wp, table = pack_weight(w, tile, mask)
    op = BsrGemvOp(folder, spec, wp, table, bias)
    for m in sorted({1, min(2, spec.rows), spec.rows}) + [1]:
        x = torch.randn(m, spec.k, device="cuda").to(act)
        y = op(x)
        ref = reference(x, w, mask, bias if spec.bias else None, spec.act, spec.bn, spec.bk)
        torch.cuda.synchronize()
        assert y.dtype == act and not y.isnan().any(), name
        assert _err(y, ref) < (1e-2 if act == torch.bfloat16 else 2e-3), f"{name} density {density} at M={m}"
    with pytest.raises(Exception, match="at most"):
        op(torch.randn(spec.rows + 1, spec.k, device="cuda").to(act))


@pytest.mark.parametrize("graph", [False, True])
def test_gemv_chained_as_programmatic_dependents_reads_what_the_previous_one_wrote(graph):
    """Launched with programmatic dependent launch, a GEMV loads its weights before the previous kernel ends: a chain
    of them, each reading the last one's output, eagerly and captured in a CUDA graph, matches the reference."""
    from sparta.templates.bsr_linear.runtime import BsrGemvOp
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.packing import pack_weight
    from sparta.templates.bsr_linear.spec import BsrSpec, reference
    folder = _folder("r_gemv_square_pdl")
    spec = BsrGemvSpec(**json.loads((folder / "spec.json").read_text()))
    assert spec.pdl and json.loads((folder / "launch.json").read_text())["pdl"]
    tile = BsrSpec(0, spec.n, spec.k, bn=spec.bn, bk=spec.bk, tm=64, warps_m=2, act=spec.act)
    ops, refs = [], []
    for _ in range(6):
        mask = torch.rand(tile.row_blocks, tile.k_blocks) < 0.5
        w, bias = torch.randn(spec.n, spec.k, device="cuda").half() * 0.1, torch.randn(spec.n, device="cuda").half()
        ops.append(BsrGemvOp(folder, spec, *pack_weight(w, tile, mask), bias))
        refs.append(lambda x, w=w, mask=mask, bias=bias: reference(x, w, mask, bias, spec.act, spec.bn, spec.bk))
    x = torch.randn(3, spec.k, device="cuda").half()

    def chain():
        y = x
        for op in ops:
            y = op(y)
        return y
    y = chain()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = chain()
        x.copy_(torch.randn_like(x))
        g.replay()
    want = x
    for ref in refs:
        want = ref(want)
    torch.cuda.synchronize()
    assert _err(y, want) < 5e-3


def _replayed_from_a_cuda_graph(module, rows: int, k: int):
    """(x, y): ``module`` captured in a CUDA graph on fp16 ``x`` of ``rows`` rows, ``x`` then refilled with fresh
    values and the graph replayed; ``y`` is what the replay wrote."""
    graph, x = torch.cuda.CUDAGraph(), torch.randn(rows, k, device="cuda").half()
    module(x)
    with torch.cuda.graph(graph):
        y = module(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    return x, y


def test_linear_module_runs_the_gemv_for_few_rows_and_the_tile_kernel_else(monkeypatch):
    from sparta.templates.bsr_linear.runtime import BsrGemvOp, SparseLinearCUDA, load_spec
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.spec import reference
    folder, g_folder = _folder("r_odd_gelu"), _folder("r_gemv_odd_gelu")
    spec, g_spec = load_spec(folder), BsrGemvSpec(**json.loads((g_folder / "spec.json").read_text()))
    mask = torch.rand(spec.row_blocks, spec.k_blocks) < 0.5
    w, bias = torch.randn(spec.n, spec.k).half(), torch.randn(spec.n).half()
    module = SparseLinearCUDA.from_weight("lin", "x", folder, spec, w, mask, bias, (0, spec.n),
                                          gemv=(g_folder, g_spec)).cuda()
    calls, gemv = [], BsrGemvOp.__call__
    monkeypatch.setattr(BsrGemvOp, "__call__", lambda self, x: calls.append(x.shape[0]) or gemv(self, x))
    for m in (1, 16, 17, 130, 5):
        x = torch.randn(2, m, spec.k, device="cuda").half()      # 2m rows: the GEMV up to 8 tokens a batch row
        y = module(x)
        ref = reference(x.reshape(-1, spec.k), w.cuda(), mask, bias.cuda(), spec.act, spec.bn, spec.bk)
        torch.cuda.synchronize()
        assert _err(y.reshape(-1, spec.n), ref) < 2e-3, f"M={2 * m}"
    assert calls == [2, 10], "the GEMV runs calls of up to 16 rows, the tile kernel the others"
    x, y = _replayed_from_a_cuda_graph(module, 3, spec.k)
    ref = reference(x, w.cuda(), mask, bias.cuda(), spec.act, spec.bn, spec.bk)
    assert _err(y, ref) < 2e-3, "a GEMV captured in a CUDA graph reads the input written after capture"


def test_linear_module_runs_the_one_row_gemv_for_one_row_and_the_few_row_gemv_above(monkeypatch):
    """A module with both GEMVs (what a compile of any rows builds): one-row calls run the GEMV built for one row,
    calls of up to 16 rows the other, each correct, also replayed from a CUDA graph."""
    from sparta.templates.bsr_linear.runtime import BsrGemvOp, SparseLinearCUDA, load_spec
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.spec import reference
    folder, g_folder, one_folder = _folder("r_odd_gelu"), _folder("r_gemv_odd_gelu"), _folder("r_gemv_odd_gelu_r1")
    spec = load_spec(folder)
    g_spec, one_spec = (BsrGemvSpec(**json.loads((f / "spec.json").read_text())) for f in (g_folder, one_folder))
    mask = torch.rand(spec.row_blocks, spec.k_blocks) < 0.5
    w, bias = torch.randn(spec.n, spec.k).half(), torch.randn(spec.n).half()
    module = SparseLinearCUDA.from_weight("lin", "x", folder, spec, w, mask, bias, (0, spec.n),
                                          gemv=(g_folder, g_spec), gemv1=(one_folder, one_spec)).cuda()
    calls, gemv = [], BsrGemvOp.__call__
    monkeypatch.setattr(BsrGemvOp, "__call__", lambda self, x: calls.append((x.shape[0], self.spec.rows))
                        or gemv(self, x))
    for m in (1, 3, 1, 16, 20):
        x = torch.randn(m, spec.k, device="cuda").half()
        ref = reference(x, w.cuda(), mask, bias.cuda(), spec.act, spec.bn, spec.bk)
        assert _err(module(x), ref) < 2e-3, f"M={m}"
    assert calls == [(1, 1), (3, 16), (1, 1), (16, 16)], calls
    x, y = _replayed_from_a_cuda_graph(module, 1, spec.k)
    assert _err(y, reference(x, w.cuda(), mask, bias.cuda(), spec.act, spec.bn, spec.bk)) < 2e-3


def test_linear_module_runs_the_tile_kernel_of_each_bucket_of_rows(monkeypatch):
    """Calls the GEMV does not take run the tile kernel of the smallest bucket that holds their rows (each over the same
    packed blocks), larger calls the module's own; each correct, also replayed from a CUDA graph."""
    from sparta.templates.bsr_linear.runtime import BsrLinearOp, SparseLinearCUDA, load_spec
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.spec import reference
    folder, b_folder, g_folder = _folder("r_odd_gelu"), _folder("r_odd_gelu_tm32"), _folder("r_gemv_odd_gelu")
    spec, b_spec = load_spec(folder), load_spec(b_folder)
    g_spec = BsrGemvSpec(**json.loads((g_folder / "spec.json").read_text()))
    mask = torch.rand(spec.row_blocks, spec.k_blocks) < 0.5
    w, bias = torch.randn(spec.n, spec.k).half(), torch.randn(spec.n).half()
    module = SparseLinearCUDA.from_weight("lin", "x", folder, spec, w, mask, bias, (0, spec.n),
                                          gemv=(g_folder, g_spec), buckets=[(40, b_folder, b_spec)]).cuda()
    tiles, call = [], BsrLinearOp.__call__
    monkeypatch.setattr(BsrLinearOp, "__call__", lambda self, x, out=None: tiles.append((x.shape[0], self.spec.tm))
                        or call(self, x, out))
    calls = (1, 9, 17, 40, 41, 130, 20)
    for m in calls:
        x = torch.randn(m, spec.k, device="cuda").half()
        ref = reference(x, w.cuda(), mask, bias.cuda(), spec.act, spec.bn, spec.bk)
        assert _err(module(x), ref) < 2e-3, f"M={m}"
    assert tiles == [(m, 32 if m <= 40 else 64) for m in calls if m > g_spec.rows], (tiles, g_spec.rows)
    x, y = _replayed_from_a_cuda_graph(module, 33, spec.k)
    assert _err(y, reference(x, w.cuda(), mask, bias.cuda(), spec.act, spec.bn, spec.bk)) < 2e-3
    with pytest.raises(Exception, match="same blocks"):
        SparseLinearCUDA.from_weight("lin", "x", folder, spec, w, mask, bias, (0, spec.n),
                                     buckets=[(40, g_folder, load_spec(_folder("r_stream_ragged_relu")))])


@pytest.mark.parametrize("name", ["r_ln_res_warp_both", "r_ln_cta_int8", "r_ln_bf16_res_warp_both", "r_ln_bf16_cta"])
def test_layer_norm_takes_any_number_of_rows(name):
    from sparta.templates.norm.runtime import LayerNormOp
    from sparta.templates.norm.spec import LayerNormSpec, layer_norm_ref
    from sparta.templates.quant.spec import quantize_rows
    folder = _folder(name)
    spec = LayerNormSpec(**json.loads((folder / "spec.json").read_text()))
    act = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16
    w, b = (torch.rand(spec.n, device="cuda") + 0.5).to(act), torch.randn(spec.n, device="cuda").to(act)
    op = LayerNormOp(folder, spec, w, b)
    for m in (1, 5, 37, 2, 130):
        x = (torch.randn(m, spec.n, device="cuda") * 4 + 3).to(act)
        r = torch.randn(m, spec.n, device="cuda").to(act) if spec.residual else None
        outs = op(x, r) if r is not None else op(x)
        outs = outs if isinstance(outs, tuple) else (outs,)
        y = layer_norm_ref(x + r if r is not None else x, w, b, spec.eps)
        if spec.out != "int8":
            assert outs[0].dtype == act
            tol = dict(rtol=1.6e-2, atol=3e-2) if act == torch.bfloat16 else dict(rtol=2e-3, atol=4e-3)
            torch.testing.assert_close(outs[0].float(), y.float(), **tol)
        if spec.out != "fp16":
            xq, xs = quantize_rows(outs[0] if spec.out == "both" else y)
            torch.testing.assert_close(outs[-1], xs, rtol=4e-3, atol=0)
            assert (outs[-2].int() - xq.int()).abs().max() <= 1, f"{name} at M={m}"


@pytest.mark.parametrize("name", ["r_quant_rows", "r_quant_bf16"])
def test_row_quantizer_takes_any_number_of_rows(name):
    from sparta.templates.quant.runtime import RowQuantizer
    from sparta.templates.quant.spec import quantize_rows
    q = RowQuantizer(_folder(name))
    for m in (1, 37, 4, 100):
        x = torch.randn(m, q.k, device="cuda").to(q.dtype)
        xq, xs = q(x)
        rq, rs = quantize_rows(x)
        assert torch.equal(xq, rq) and torch.equal(xs, rs), f"M={m}"


@pytest.mark.parametrize("density", [0.0, 0.35, 1.0])
@pytest.mark.parametrize("tile_name, gemv_name", [("r_gate_odd_silu", "r_gemv_gate_silu"),
                                                  ("r_gate_bf16_gelu_tm32", "r_gemv_gate_bf16_gelu"),
                                                  ("r_gate_odd_silu", "r_gemv_gate_l2_i4_silu")])
def test_gated_kernels_write_act_gate_times_up(tile_name, gemv_name, density):
    """A gated linear unit's tile kernel and its GEMV over one packing (gate and up blocks of a slot, the gate's
    counted apart) write act(gate) · up at every row count, N and K ragged, as the reference computes it from the
    (2N, K) weight; nothing of the (M, 2N) product is written."""
    from sparta.templates.bsr_linear.runtime import BsrGemvOp, BsrLinearOp, load_spec
    from sparta.runtime.cuda import act16_dtype
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.spec import reference
    tile_folder, gemv_folder = _folder(tile_name), _folder(gemv_name)
    spec, gspec = load_spec(tile_folder), BsrGemvSpec(**json.loads((gemv_folder / "spec.json").read_text()))
    assert spec.gate and gspec.gate and spec.m == 0
    act = act16_dtype(spec)
    mask = torch.rand(spec.weight_row_blocks, spec.k_blocks) < density
    w = torch.randn(2 * spec.n, spec.k, device="cuda").to(act)
    bias = torch.randn(2 * spec.n, device="cuda").to(act) if spec.bias else None
    op = BsrLinearOp(tile_folder, spec, w, mask, bias)
    gemv = BsrGemvOp(gemv_folder, gspec, op.wp, op.table, op.bias)
    tol = 1e-2 if act == torch.bfloat16 else 2e-3
    for m in ROWS:
        x = torch.randn(m, spec.k, device="cuda").to(act)
        out = torch.full((m, spec.n), float("nan"), device="cuda", dtype=act)
        op(x, out=out)
        ref = reference(x, w, mask, bias, spec.act, spec.bn, spec.bk, gate=True)
        torch.cuda.synchronize()
        assert ref.shape == (m, spec.n) and not out.isnan().any() and _err(out, ref) < tol, f"{tile_name} at M={m}"
        if m <= gspec.rows:
            y = gemv(x)
            assert y.shape == (m, spec.n) and _err(y, ref) < tol, f"{gemv_name} at M={m}"
