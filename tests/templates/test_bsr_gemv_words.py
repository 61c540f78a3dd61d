"""The W4A16 tile that reads the W4A16 GEMVs' pack (``BsrSpec(gemv_group=...)``), torch side and compile-only: one
packed weight per 4-bit linear, the K order its MMAs use (emulated fragment by fragment), refusals and the build."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.templates.bsr_linear.int4_records import dequantize_w4, expand_groups, gemv_layout, pack_w4, quantize_w4, \
    unpack_w4
from sparta.templates.bsr_linear.kernel import bsr_linear
from sparta.templates.bsr_linear.spec import BsrSpec
from sparta.templates.w4a16_gemv.spec import flat_views, pack_codes


def _spec(n, k, group, zero=False, out="float16", bn=128):
    return BsrSpec(0, n, k, bn=bn, bk=128, tm=64, warps_m=1, warps_n=bn // 32, stages=4, dtype="w4a16", zero=zero,
                   out=out, gemv_group=group)


def _codes(n, k, group, zero, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    codes, scale, z = quantize_w4(w, group, zero, dtype)
    return codes, scale, z


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), kq=st.integers(1, 10), group=st.sampled_from([32, 64, 128]), zero=st.booleans(),
       bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_the_tile_holds_exactly_the_gemvs_pack(n, kq, group, zero, bf16, seed):
    """The tile's weight is the GEMVs' words, scales and zero points in one buffer (their views), and applies the same
    dequantised weight as records would: K a multiple of the group, often not of 128; N often not of 8 or of bn."""
    k = group * kq
    dtype = torch.bfloat16 if bf16 else torch.float16
    codes, scale, z = _codes(n, k, group, zero, seed, dtype)
    spec = _spec(n, k, group, zero, "bfloat16" if bf16 else "float16")
    flat, table = pack_w4(codes, expand_groups(scale, group, k), None if z is None else expand_groups(z, group, k),
                          spec, torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool))
    layout = gemv_layout(spec)
    views = flat_views(flat, layout)
    for got, want in zip(views, pack_codes(codes, scale, z, layout)):
        assert (got is None and want is None) or torch.equal(got, want)
    assert table.numel() == spec.table_head + spec.row_blocks * spec.k_blocks
    deq = dequantize_w4(codes, expand_groups(scale, group, k), None if z is None else expand_groups(z, group, k), dtype)
    assert torch.equal(unpack_w4(flat, table, spec), deq)


def _deq(code: int, zero: int, scale: torch.Tensor) -> float:
    """One weight as ``mul.f16x2`` makes it: the exact ``code - zero`` times the scale, rounded once to fp16."""
    return float(((code - zero) * scale.float()).half())


def _nibbles(word: int) -> list[int]:
    return [(word >> (4 * p)) & 0xF for p in range(8)]


@pytest.mark.parametrize("zero", [False, True])
def test_the_kernels_fragments_multiply_the_right_k(zero):
    """``mma_stage_gemv_words`` emulated: ``Yᵀ = W·Xᵀ`` as the GEMV computes it. Per lane (g, t), word j and k16 step
    h, the A fragment from the lop3 pairs of two 8-row tiles' words (a0/a2: tile 0's pairs 2h, 2h+1; a1/a3: tile 1's)
    and the B fragment from the 16-byte X load of row g at chunk 4t + j (its words 2h, 2h+1) — the indices the
    kernel uses; the m16n8k16 products over one 128-K chunk equal (X · Wᵀ)ᵀ."""
    n, k, group = 16, 128, 32
    codes, scale, z = _codes(n, k, group, zero, 7)
    spec = _spec(n, k, group, zero, bn=32)
    flat, _ = pack_w4(codes, expand_groups(scale, group, k), None if z is None else expand_groups(z, group, k), spec,
                      torch.ones(1, 1, dtype=torch.bool))
    wq, s, zp = flat_views(flat, gemv_layout(spec))
    x = torch.randn(8, k, dtype=torch.float64)
    c = torch.zeros(16, 8, dtype=torch.float64)
    for j in range(4):
        for h in range(2):
            a, b = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
            for lane in range(32):
                g, t = divmod(lane, 4)
                q = 32 * t // group                                         # the lane's scale group in the chunk
                for tile in range(2):
                    zero_point = 8 if zp is None else int(zp[tile, q, g])
                    nib = _nibbles(int(wq[tile, 0, lane, j]) & 0xFFFFFFFF)
                    pairs = [(_deq(nib[p], zero_point, s[tile, q, g]), _deq(nib[p + 4], zero_point, s[tile, q, g]))
                             for p in range(4)]                             # lop3: nibbles (p, p + 4) -> half2 p
                    a[tile * 8 + g, 2 * t: 2 * t + 2] = torch.tensor(pairs[2 * h], dtype=torch.float64)       # a0/a1
                    a[tile * 8 + g, 2 * t + 8: 2 * t + 10] = torch.tensor(pairs[2 * h + 1], dtype=torch.float64)  # a2/a3
                xr = x[g, 32 * t + 8 * j: 32 * t + 8 * j + 8]                   # the 16-byte load: xr[0..3]
                b[2 * t: 2 * t + 2, g] = xr[4 * h: 4 * h + 2]                   # b0 = xr[2h]
                b[2 * t + 8: 2 * t + 10, g] = xr[4 * h + 2: 4 * h + 4]          # b1 = xr[2h + 1]
            c += a @ b
    w = unpack_w4(flat, torch.zeros(0), spec).double()
    torch.testing.assert_close(c, (x @ w.T).T)


def test_the_pack_is_refused_where_it_cannot_serve():
    codes, scale, _ = _codes(64, 256, 64, False, 0)
    spec = _spec(64, 256, 64, bn=32)
    full = torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool)
    with pytest.raises(ValueError, match="dense"):
        pack_w4(codes, expand_groups(scale, 64, 256), None, spec, ~full)
    varying = expand_groups(scale, 64, 256).clone()
    varying[:, 3] *= 2
    with pytest.raises(ValueError, match="group of 64"):
        pack_w4(codes, varying, None, spec, full)
    with pytest.raises(ValueError, match="gemv_group"):
        BsrSpec(0, 64, 256, bn=32, bk=64, tm=64, warps_m=1, dtype="w4a16", gemv_group=64)       # bk 64
    with pytest.raises(ValueError, match="gemv_group"):
        BsrSpec(0, 64, 96, bn=32, bk=128, tm=64, warps_m=1, dtype="w4a16", gemv_group=64)       # K % group
    with pytest.raises(ValueError, match="gemv_group"):
        BsrSpec(0, 64, 256, bn=32, bk=128, tm=64, warps_m=1, gemv_group=128)                    # fp16
    with pytest.raises(ValueError, match="bytes"):
        flat_views(torch.zeros(10, dtype=torch.uint8), gemv_layout(spec))
    assert "gemv_group" not in BsrSpec(0, 64, 256, bn=32, bk=128, tm=64, warps_m=1, dtype="w4a16").key()
    assert spec.key()["gemv_group"] == 64


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("zero", [False, True])
def test_the_tile_over_the_gemvs_pack_builds(tmp_path, monkeypatch, zero):
    """No ldmatrix (X's fragments are 16-byte shared loads in the GEMV's K order), 16-byte copies of the words and
    scales, 8-byte ones of the zero points."""
    from sparta.codegen.cuda_build import build_cuda
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(0, 200, 416, bn=128, bk=128, tm=64, warps_m=1, warps_n=4, stages=4, act="relu", dtype="w4a16",
                   zero=zero, gemv_group=32, name="w4_gemv_words")
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    assert "lop3.b32" in src and "ldmatrix" not in src
    assert ("cp.async.ca.shared.global [%0], [%1], 8" in src) == zero
    assert {a["name"] for a in art.launch["args"]} == {"M", "X", "Wp", "B", "Tab", "Y"}
