"""The block-sparse 16-bit GEMV's parallelism knobs (``BsrGemvSpec.loads``, ``inflight``): the sizes they derive, keys
and saved specs as they were at their defaults, and compile-only builds of the new variants (TVM and nvcc, no GPU).
The kernels' numbers are checked on the GPU (``tests/runtime/test_cuda_any_rows.py``, the ``r_gemv_l*`` fixtures)."""

import dataclasses
import json
import re
import shutil

import pytest

from sparta.codegen.cuda_build import build_cuda, cuda_source
from sparta.templates.bsr_linear.gemv import bsr_gemv
from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@pytest.mark.parametrize("kw, lane_loads, unit_rows, ctas", [
    (dict(n=4096, k=4096), 4, 32, 128),                          # the default rule: every row of a 32-row block
    (dict(n=4096, k=4096, loads=2), 2, 16, 256),
    (dict(n=4096, k=4096, loads=1), 1, 8, 512),
    (dict(n=11008, k=4096, gate=True, loads=1), 1, 8, 344 * 4),  # a slot: one gate and one up block row
    (dict(n=100, k=40, loads=2), 2, 16, 4 * 2),                  # ragged N: the last block row's CTAs too
    (dict(n=256, k=640, bn=64, bk=128), 4, 8, 4 * 8),            # 16 lanes per block row: 2 rows a load
    (dict(n=256, k=640, bn=64, bk=128, loads=1), 1, 2, 4 * 32),
    (dict(n=48, k=64, bn=16, bk=16), 1, 16, 3),                  # 16-blocks: one load fills the block
])
def test_loads_set_the_rows_a_cta_owns(kw, lane_loads, unit_rows, ctas):
    spec = BsrGemvSpec(**kw)
    assert (spec.lane_loads, spec.unit_rows, spec.ctas) == (lane_loads, unit_rows, ctas)
    assert spec.inflight == 2


@pytest.mark.parametrize("bad, match", [(dict(loads=3), "loads=3"), (dict(loads=8), "loads=8"),
                                        (dict(inflight=3), "inflight=3"), (dict(inflight=0), "inflight=0"),
                                        (dict(bn=16, bk=16, loads=2), "multiple of the 32 rows")])
def test_spec_refuses_knobs_the_kernel_cannot_run(bad, match):
    with pytest.raises(ValueError, match=match):
        BsrGemvSpec(**{**dict(n=96, k=64), **bad})


def test_default_knobs_keep_keys_saved_specs_and_source():
    """At their defaults the knobs leave the cache key as it was (a key omits them) and a ``spec.json`` written before
    they existed loads as the same spec; set, they are in the key and survive the JSON. Naming the default rule's
    loads and inflight 2 emits the default kernel."""
    spec = BsrGemvSpec(96, 72, act="gelu_tanh")
    assert "loads" not in spec.key() and "inflight" not in spec.key() and "gate" not in spec.key()
    old = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("loads", "inflight")}
    assert BsrGemvSpec(**old) == spec
    tuned = dataclasses.replace(spec, loads=1, inflight=4)
    assert tuned.key()["loads"] == 1 and tuned.key()["inflight"] == 4 and tuned.key() != spec.key()
    assert BsrGemvSpec(**json.loads(json.dumps(dataclasses.asdict(tuned)))) == tuned
    named = dataclasses.replace(spec, loads=spec.lane_loads, inflight=2)
    assert named.key() != spec.key() and cuda_source(bsr_gemv, named) == cuda_source(bsr_gemv, spec)
    assert cuda_source(bsr_gemv, tuned) != cuda_source(bsr_gemv, spec)


def _body(src: str) -> str:
    body = src[src.index('extern "C" __global__'):]
    return body[body.index("{"):]


@needs_nvcc
@pytest.mark.parametrize("kw", [
    dict(n=200, k=520, rows=1, warps=4, loads=1, inflight=4, dtype="bfloat16", bias=False),
    dict(n=88, k=72, rows=4, warps=1, loads=2, inflight=4, act="silu", gate=True, pdl=True),   # N and K ragged
    dict(n=100, k=200, rows=4, warps=2, loads=1, inflight=4, act="relu", pdl=True),
])
def test_four_blocks_in_flight_load_every_block_and_x_piece_before_a_product(tmp_path, monkeypatch, kw):
    """With four blocks in flight a warp issues its round's four weight loads and K indices, then (after the grid
    dependency wait, with pdl) the four blocks' X pieces, and only then multiplies; the grid has a CTA per
    ``unit_rows`` rows of each block row, the locals hold four blocks and four X pieces a row."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrGemvSpec(**kw, name="probe_gemv_in4")
    art = build_cuda(bsr_gemv, spec)
    assert sorted(art.launch["cubins"]) == ["sm_80", "sm_90"]
    assert art.launch["grid"][0] == spec.ctas and art.launch["block"][0] == 32 * spec.warps
    body = _body((art.path / "kernel.cu").read_text())
    j = spec.lane_loads
    assert f"half wv_ptr[{4 * j * 8}];" in body and "int kb_ptr[4];" in body
    assert f"half xv_ptr[{4 * spec.rows * 8}];" in body
    loop = body[body.index("for (int t = 0;"):]
    kidx = [loop.index(f"kb_ptr[{o}] = ") for o in range(4)]
    xload = [m.start() for m in re.finditer(r"\(xv_ptr \+ \d+\) = \*\(uint4\*\)\(X_ptr", loop)]
    first_fma = loop.index("acc_ptr[0] = (acc_ptr[0] +")
    assert len(xload) == 4 * spec.rows, "every row's X piece of every block, vectorised"
    assert max(kidx) < min(xload) and max(xload) < first_fma
    if spec.pdl:
        assert max(kidx) < loop.index("sparta_grid_wait();") < min(xload)
    if spec.gate:                                  # the gate's sums and the up's
        assert f"acc_ptr[{spec.lane_loads * spec.rows}] = (acc_ptr[{spec.lane_loads * spec.rows}] +" in loop


@needs_nvcc
def test_one_block_in_flight_and_one_row_build(tmp_path, monkeypatch):
    """``inflight=1``: one block (its K index, ``loads`` pieces a lane) a round and one row's X piece; 16 rows a CTA."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrGemvSpec(160, 160, act="gelu_tanh", rows=1, loads=2, inflight=1, pdl=True, name="probe_gemv_in1")
    art = build_cuda(bsr_gemv, spec)
    assert spec.unit_rows == 16 and art.launch["grid"][0] == 5 * 2 and art.launch["pdl"] is True
    body = _body((art.path / "kernel.cu").read_text())
    assert "half wv_ptr[16];" in body and "int kb_ptr[1];" in body and "half xv_ptr[8];" in body
    assert "kb_ptr[1] =" not in body
    loop = body[body.index("for (int t = 0;"):]
    assert loop.index("kb_ptr[0] = ") < loop.index("sparta_grid_wait();") < loop.index("X_ptr")


@needs_nvcc
def test_a_programmatically_dependent_kernel_reads_its_input_coherently(tmp_path, monkeypatch):
    """Built for PDL, the GEMV's pointers lose ``__restrict__``: nvcc's PTX then reads X with ordinary loads, none of
    them the non-coherent ``ld.global.nc`` that ptxas moved above ``griddepcontrol.wait`` (a kernel launched while its
    predecessor still wrote X read stale X). Built without PDL, the pointers stay restrict and the loads read-only (it waits for nothing)."""
    import subprocess
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    ptx = {}
    for pdl in (True, False):
        spec = BsrGemvSpec(96, 64, rows=4, pdl=pdl, name=f"probe_gemv_pdl{int(pdl)}")
        art = build_cuda(bsr_gemv, spec)
        src = (art.path / "kernel.cu").read_text()
        assert (src == cuda_source(bsr_gemv, spec)) and (("__restrict__" in src) != pdl)
        out = tmp_path / f"{spec.name}.ptx"
        subprocess.run(["nvcc", "-arch=sm_90", "-ptx", str(art.path / "kernel.cu"), "-o", str(out)], check=True)
        ptx[pdl] = out.read_text()
    wait = ptx[True].index("griddepcontrol.wait")
    assert "ld.global.nc" not in ptx[True] and "ld.global" in ptx[True][wait:]
    assert "ld.global.nc" in ptx[False]
