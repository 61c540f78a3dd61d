"""``bsr_linear``'s W4A16 kernel, torch side and compile-only: int4 block records (``bsr_linear/int4_records.py``), the
B-fragment layout the in-register dequantisation reads, spec checks and the build."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparta.templates.bsr_linear.int4_records import dequantize_w4, expand_groups, pack_w4, quantize_w4, unpack_w4
from sparta.templates.bsr_linear.kernel import bsr_linear
from sparta.templates.bsr_linear.spec import BsrSpec, record_lanes
from sparta.templates.w4a16_gemv.spec import ORDER


def _codes(n, k, group, zero, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    codes, scale, z = quantize_w4(w, group, zero)
    return w, codes, expand_groups(scale, group, k), None if z is None else expand_groups(z, group, k)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70), kq=st.integers(1, 12), bn=st.sampled_from([16, 32, 64]), bk=st.sampled_from([32, 64, 128]),
       group=st.sampled_from([32, 64, 128, 4096]), zero=st.booleans(), density=st.sampled_from([0.0, 0.4, 1.0]),
       seed=st.integers(0, 2**16))
def test_records_round_trip_to_the_dequantised_weight(n, kq, bn, bk, group, zero, density, seed):
    k = 8 * kq * 3                                     # K a multiple of 8, often not of the block
    w, codes, scale, z = _codes(n, k, group, zero, seed)
    spec = BsrSpec(5, n, k, bn=bn, bk=bk, tm=16, warps_m=1, stages=2, dtype="w4a16", zero=zero)
    mask = torch.rand(spec.row_blocks, spec.k_blocks, generator=torch.Generator().manual_seed(seed)) < density
    wp, table = pack_w4(codes, scale, z, spec, mask)
    assert wp.dtype == torch.uint8 and wp.shape == (max(int(mask.sum()), 1), 2 * record_lanes(bn, bk, zero))
    keep = mask.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    deq = dequantize_w4(codes, scale, z)
    assert torch.equal(unpack_w4(wp, table, spec), deq * keep)
    step = scale.float()
    assert torch.all((deq.float() - w).abs() <= step / 2 + 2e-3 * w.abs() + 1e-6)   # RTN: half a step (+ fp16)


def test_words_hold_each_lanes_b_fragments():
    """Lane 4g+t of 8-row group n8, word kw: the four half2 that lop3 makes (nibbles (0,4), (1,5),
    (2,6), (3,7)) are B[k][n] of m16n8k16 steps 2kw and 2kw+1 at k = (2t, 2t+1), (2t+8, 2t+9)."""
    n, k, bn, bk = 16, 128, 16, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    spec = BsrSpec(5, n, k, bn=bn, bk=bk, tm=16, warps_m=1, stages=2, dtype="w4a16")
    wp, _ = pack_w4(codes, torch.ones(n, k).half(), None, spec, torch.ones(1, 1, dtype=torch.bool))
    words = wp[0][: bn * bk // 2].view(torch.int32).reshape(bn // 8, 32, bk // 32)
    for n8 in range(bn // 8):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for kw in range(bk // 32):
                word = int(words[n8, lane, kw]) & 0xFFFFFFFF
                nib = [(word >> (4 * p)) & 0xF for p in range(8)]
                halves = [(nib[0], nib[4]), (nib[1], nib[5]), (nib[2], nib[6]), (nib[3], nib[7])]
                for i, (lo, hi) in enumerate(halves):
                    step, upper = divmod(i, 2)
                    k0 = kw * 32 + step * 16 + upper * 8 + 2 * t
                    assert (lo, hi) == (int(codes[8 * n8 + g, k0]), int(codes[8 * n8 + g, k0 + 1]))
    assert ORDER == (0, 4, 1, 5, 2, 6, 3, 7)


def test_scales_must_be_constant_over_32_columns():
    _, codes, scale, _ = _codes(8, 64, 32, False, 0)
    spec = BsrSpec(5, 8, 64, bn=16, bk=32, tm=16, warps_m=1, stages=2, dtype="w4a16")
    scale[:, 5] *= 2
    with pytest.raises(ValueError, match="32-column"):
        pack_w4(codes, scale, None, spec, torch.ones(1, 2, dtype=torch.bool))


def test_bad_w4a16_specs_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        BsrSpec(64, 64, 64, bn=32, bk=16, tm=64, warps_m=2, dtype="w4a16")
    with pytest.raises(ValueError, match="w4a16"):
        BsrSpec(64, 64, 64, bn=64, bk=64, tm=64, warps_m=1, stages=3, dtype="w4a16", mma="wgmma")
    with pytest.raises(ValueError, match="zero points"):
        BsrSpec(64, 64, 64, bn=32, bk=32, tm=64, warps_m=2, zero=True)


def test_w4a16_key_and_shared_memory():
    fp16 = BsrSpec(64, 64, 256, bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=3)
    w4 = BsrSpec(64, 64, 256, bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=3, dtype="w4a16", zero=True)
    assert "zero" not in fp16.key() and w4.key()["zero"] is True
    # per stage: X tile + (words + scales + zero points) of one block, vs the fp16 block's 64*64 lanes
    consts = 64 * 8                   # fp32 (ws, ws', b, b') per column pair
    assert w4.shared_bytes == 3 * (64 * 64 + 64 * 64 // 4 + 2 * 64 + 64) * 2 + consts
    assert fp16.shared_bytes == 3 * (64 * 64 + 64 * 64) * 2 + consts


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("zero", [False, True])
def test_w4a16_kernel_builds_with_lop3_dequantisation(tmp_path, monkeypatch, zero):
    from sparta.codegen.cuda_build import build_cuda
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = BsrSpec(100, 96, 192, bn=32, bk=64, tm=64, warps_m=2, stages=3, act="relu", dtype="w4a16", zero=zero,
                   name="w4_build")
    art = build_cuda(bsr_linear, spec)
    src = (art.path / "kernel.cu").read_text()
    assert "lop3.b32" in src and "sub.f16x2" in src and "m16n8k16.row.col.f32.f16.f16.f32" in src
    # ldmatrix only for A: (bk / 16 steps) x (2 m16 tiles per warp) calls, plus the helper's definition
    assert src.count("tvm_builtin_ptx_ldmatrix_sync_aligned_m8n8_x4_shared_b16") == 64 // 16 * 2 + 1
    assert (str(0x64086408) in src) != zero          # half2(1032): the symmetric zero point is a constant
    assert sorted(art.launch["cubins"]) == ["sm_80", "sm_90"]
    assert {a["name"] for a in art.launch["args"]} == {"X", "Wp", "B", "Tab", "Y"}


@pytest.mark.parametrize("n,k,bn,bk,group,zero,act,density,groups,seed,digests", [
    (200, 384, 64, 128, 64, False, "float16", 0.6, 0, 1, ("6fefd3442b6893cb", "cae78c4492d099c2")),
    (130, 256, 64, 64, 32, True, "bfloat16", 0.5, 3, 2, ("07b24a4acae5877d", "d44d7ac5cf720652")),
    (256, 512, 128, 128, 128, False, "bfloat16", 1.0, 0, 3, ("ef7452d422fa91bb", "ca8206314ccc7e2f"))])
def test_records_and_their_unpacking_are_pinned(n, k, bn, bk, group, zero, act, density, groups, seed, digests):
    """The packed bytes, table and unpacked weight are those of the 64-bit element loop the vectorised packing
    replaced (its SHA-256 prefixes): saved folders and GPU fixtures stay valid."""
    import hashlib
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    codes, scale, z = quantize_w4(w, group, zero, torch.bfloat16 if act == "bfloat16" else torch.float16)
    spec = BsrSpec(0, n, k, bn=bn, bk=bk, dtype="w4a16", zero=zero, out=act, groups=groups)
    mask = torch.rand(spec.row_blocks, spec.k_blocks, generator=g) < density
    wp, table = pack_w4(codes, expand_groups(scale, group, k), None if z is None else expand_groups(z, group, k),
                        spec, mask)
    packed = hashlib.sha256(wp.numpy().tobytes() + table.numpy().tobytes()).hexdigest()[:16]
    unpacked = hashlib.sha256(unpack_w4(wp, table, spec).view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    assert (packed, unpacked) == digests
