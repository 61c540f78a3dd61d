"""The streaming ``bsr_linear`` grid (``BsrSpec(groups=G)``, ``templates/bsr_linear/stream.py``): its table
and a compile-only build (the GPU tests in ``tests/runtime/test_cuda_bsr.py`` run the ``t_stream_*`` kernels)."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.codegen.cuda_build import build_cuda
from sparta.templates.bsr_linear.int4_records import pack_w4, unpack_w4
from sparta.templates.bsr_linear.kernel import bsr_linear
from sparta.templates.bsr_linear.packing import build_table, pack_weight, table_parts, unpack_weight
from sparta.templates.bsr_linear.spec import BsrSpec

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 9), groups=st.integers(1, 15), seed=st.integers(0, 2 ** 16),
       density=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_groups_partition_rows_and_blocks_and_balance_work(rows, cols, groups, seed, density):
    mask = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) < density
    table, packed = build_table(mask, groups)
    spec = BsrSpec(16, rows * 16, cols * 16, bn=16, bk=16, tm=16, warps_m=1, groups=groups)
    head, kidx = table_parts(table, spec)
    marks = table[3 * rows: 3 * rows + spec.table_tail].reshape(-1, 2).tolist()
    assert marks[0] == [0, 0] and marks[-1] == [rows, len(packed)] == [rows, int(mask.sum())]
    assert sorted(r for r, _, _ in head) == list(range(rows))
    loads = []
    for (s0, b0), (s1, b1) in zip(marks, marks[1:]):
        slots = head[s0:s1]
        assert [f for _, f, _ in slots] == [b0 + sum(c for _, _, c in slots[:i]) for i in range(len(slots))]
        assert b1 - b0 == sum(c for _, _, c in slots)                 # each group's blocks are contiguous
        loads.append(sum(c + 1 for _, _, c in slots))
    heaviest = max(int(c) for c in mask.sum(1)) + 1
    assert max(loads) - min(loads) <= heaviest, "greedy dealing keeps groups within one row of each other"
    for (r, first, count) in head:
        assert kidx[first:first + count] == torch.nonzero(mask[r]).flatten().tolist()
        assert packed[first:first + count] == [(r, k) for k in kidx[first:first + count]]


@pytest.mark.parametrize("dtype", ["float16", "w4a16"])
def test_pack_unpack_round_trip_with_groups(dtype):
    spec = BsrSpec(64, 70, 96, bn=16, bk=32, tm=64, warps_m=4, groups=3, dtype=dtype)
    mask = torch.rand(spec.row_blocks, spec.k_blocks) < 0.5
    w = torch.randn(spec.n, spec.k)
    keep = mask.repeat_interleave(16, 0).repeat_interleave(32, 1)[: spec.n, : spec.k]
    if dtype == "float16":
        wp, tab = pack_weight(w, spec, mask)
        assert torch.equal(unpack_weight(wp, tab, spec), (w * keep).half())
    else:
        codes = torch.randint(0, 16, (spec.n, spec.k))
        scale = torch.rand(spec.n, spec.k // 32).repeat_interleave(32, 1) + 0.5
        wp, tab = pack_w4(codes, scale, None, spec, mask)
        expect = ((codes.float() - 8) * scale.half().float()).half() * keep
        assert torch.equal(unpack_w4(wp, tab, spec), expect.half())
    assert tab.numel() == 3 * spec.row_blocks + 2 * (3 + 1) + int(mask.sum())


def test_streaming_spec_rules():
    with pytest.raises(ValueError, match="groups"):
        BsrSpec(64, 64, 64, bn=32, bk=32, tm=64, warps_m=1, stages=3, groups=2, mma="wgmma")
    with pytest.raises(ValueError, match="groups"):
        BsrSpec(64, 64, 64, groups=-1)
    tile = dict(bn=64, bk=16, tm=128, warps_m=4, stages=2)
    plain, stream = BsrSpec(64, 64, 64, **tile), BsrSpec(64, 64, 64, groups=2, **tile)
    assert "groups" not in plain.key() and stream.key()["groups"] == 2     # old kernels keep their cache keys
    assert plain.shared_bytes == 128 * (64 + 8) * 2 + 64 * 8, "the one-tile kernel stages its output tile (+ constants)"
    assert stream.shared_bytes == (2 * (128 * 16 + 64 * 16) + 128 * (64 + 8)) * 2 + 2 * 64 * 8, \
        "the tile beside the stages, then two buffers of column constants"


@needs_nvcc
def test_streaming_kernel_builds_with_one_cta_per_tile_and_group(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(200, 99, 72, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="relu", groups=3, name="probe_stream")
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    assert art.launch["grid"][:2] == [-(-200 // 64), 3] and art.launch["block"][0] == 64
    assert art.launch["shared_bytes"] == spec.shared_bytes
    assert "mma.sync.aligned.m16n8k16" in src and "cp.async.cg.shared.global" in src
    even = build_cuda(bsr_linear, BsrSpec(**{**spec.__dict__, "n": 96, "name": "probe_stream_even"}))
    assert "uint4" in (even.path / "kernel.cu").read_text(), "the output tile leaves in 16-byte stores"
