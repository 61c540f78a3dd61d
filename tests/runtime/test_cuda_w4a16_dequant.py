"""The W4A16 dequantisation kernel on the GPU against its torch reference (bit for bit), and a 4-bit SwiGLU MLP
compiled where TVM is (``tests/fixtures/cuda_specs_w4a16_dequant.py``), loaded on a GPU: few rows on the W4A16 GEMVs,
more on the tile kernel, from ``dense_from`` rows on cuBLAS over the weight dequantised at each call (no copy kept);
every row count matches the model with the weights the kernels apply, also when a call replays."""

import pytest
import torch

from sparta.templates.w4a16_gemv.dequant import W4DequantOp, dequant_ref
from sparta.templates.w4a16_gemv.spec import pack_codes, quantize, codes_of

from fixtures.artifacts import MISSING, ROOT, load_saved
from fixtures.cuda_specs_w4a16_dequant import fixture_specs
from fixtures.kernel_choices import check_w4_prefill

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SPECS = fixture_specs()


def _op(name) -> W4DequantOp:
    folder = ROOT / name
    if not (folder / "launch.json").is_file():
        pytest.skip(MISSING + f"kernel {name} not built in {ROOT}")
    return W4DequantOp(folder, SPECS[name])


def _packed(spec, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(spec.n, spec.k, device="cuda", generator=g)
    scale, zero = quantize(w, spec.group, spec.sym)
    return pack_codes(codes_of(w, scale, zero, spec.group), scale, zero, spec.gemv)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_kernel_writes_the_reference_bit_for_bit_into_a_given_buffer(name):
    op, spec = _op(name), SPECS[name]
    wq, s, z = _packed(spec, 0)
    want = dequant_ref(wq, s, z, spec)
    assert torch.equal(op(wq, s, z), want)
    out = torch.full((spec.n, spec.k), float("nan"), dtype=want.dtype, device="cuda")
    assert op(wq, s, z, out=out) is out and torch.equal(out, want), "every element written"
    with pytest.raises(Exception, match="contiguous"):
        op(wq, s, z, out=out[:, :-8])


def test_kernel_replays_in_a_cuda_graph_on_new_codes():
    name = "w4dq_zero_g32_bf16"
    op, spec = _op(name), SPECS[name]
    wq, s, z = _packed(spec, 1)
    out = torch.empty(spec.n, spec.k, dtype=torch.bfloat16, device="cuda")
    op(wq, s, z, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(wq, s, z, out=out)
    for seed in (2, 3):
        new = _packed(spec, seed)
        for t, v in zip((wq, s, z), new):
            t.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, dequant_ref(*new, spec)), seed


def _compare(model, reference, rows, seed):
    x = torch.randn(1, rows, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    with torch.no_grad():
        out, want = model(x.bfloat16()), reference(x.bfloat16())
    out, want = (o[0] if isinstance(o, tuple) else o for o in (out, want))
    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert out.shape == want.shape and err < 3e-2, (rows, err)


def test_every_row_count_matches_the_model_on_the_kernel_its_plan_names():
    model = load_saved("saved_w4_prefill")
    mods = check_w4_prefill(model)
    reference = model.reference().to("cuda")
    switch = min(m.dense_from for m in mods.values())
    for rows in sorted({1, 5, 16, 17, 300, switch - 1, switch, switch + 37, 1500}):
        _compare(model, reference, rows, rows)
    assert all(m.dense_w is None for m in mods.values()), "no dense copy kept: the weight is dequantised per call"


def test_repeated_many_row_calls_replay_the_dequantising_path_with_new_inputs():
    model = load_saved("saved_w4_prefill")
    mods = check_w4_prefill(model)
    reference = model.reference().to("cuda")
    rows = max(m.dense_from for m in mods.values()) + 3
    for seed in range(3):
        _compare(model, reference, rows, seed)
