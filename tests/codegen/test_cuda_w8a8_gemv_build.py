"""W8A8 GEMV (int8 weights per channel, int8 activations per token): the spec, the reference and compile-only
CUDA builds (no GPU)."""

import shutil

import pytest
import torch

from sparta.codegen.cuda_build import build_cuda
from sparta.templates.quant.spec import quantize_rows
from sparta.templates.w8a8_gemv.kernel import w8a8_gemv
from sparta.templates.w8a8_gemv.spec import W8A8GemvSpec, argument_names, reference

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def test_reference_is_the_scaled_exact_int8_product():
    g = torch.Generator().manual_seed(0)
    xq, xs = quantize_rows(torch.randn(3, 96, generator=g) * 5)
    wq, ws = quantize_rows(torch.randn(40, 96, generator=g))
    bias = torch.randn(40, generator=g).half()
    exact = (xq.double() @ wq.double().t()) * xs.double()[:, None] * ws.double()[None, :] + bias.double()
    got = reference(xq, xs, wq, ws, bias, "relu")
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), exact.clamp_min(0).half().float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bad,match", [(dict(m=17), "M=17"), (dict(k=1000), "multiple of 16"),
                                       (dict(k=140_000), "below"), (dict(warps=3), "warps"),
                                       (dict(act="tanh"), "activation"), (dict(pdl="yes"), "pdl")])
def test_spec_refuses_what_the_kernel_cannot_run(bad, match):
    with pytest.raises(ValueError, match=match):
        W8A8GemvSpec(**{**dict(m=1, n=64, k=512), **bad})


@needs_nvcc
@pytest.mark.parametrize("pdl", ["", "early", "late"])
def test_build_streams_weights_into_dp4a_and_waits_before_reading_x(tmp_path, monkeypatch, pdl):
    """Odd N, K not a multiple of the 512 bytes a warp loads (lanes past K skip their last chunk), 3 rows, bias and
    ReLU. The weights stream through 16-byte non-allocating loads into ``dp4a.s32.s32``; with ``pdl`` the first
    batch of weights loads before ``griddepcontrol.wait`` and X, its scales and Y only after it."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = W8A8GemvSpec(3, 101, 1040, warps=4, group=2, bias=True, act="relu", pdl=pdl, name=f"probe_w8g{pdl}")
    art = build_cuda(w8a8_gemv, spec)
    src = (art.path / "kernel.cu").read_text()
    assert "dp4a.s32.s32" in src and "ld.global.nc.L1::no_allocate.v4" in src
    assert sorted(art.launch["cubins"]) == ["sm_80", "sm_90"] and art.launch["block"][0] == 128
    assert art.launch["grid"][0] == -(-101 // 4) and {a["name"] for a in art.launch["args"]} == set(argument_names(spec))
    body = src[src.index('extern "C" __global__'):]
    body = body[body.index("{"):]
    if pdl:
        wait = body.index("sparta_grid_wait();")
        assert body.index("ld_vec_global_nc") < wait < body.index("XQ_ptr") and wait < body.index("XS_ptr")
        assert wait < body.index("Y_ptr[") and art.launch["pdl"] is True
    else:
        assert "griddepcontrol" not in src and "pdl" not in art.launch


@pytest.mark.parametrize("n,k", [(37, 96), (16, 32), (200, 2080)])
def test_mma_packing_puts_each_lanes_a_fragment_in_one_16_byte_load(n, k):
    from sparta.templates.w8a8_gemv.spec import pack_mma, unpack_mma
    g = torch.Generator().manual_seed(n + k)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    packed = pack_mma(w)
    assert packed.shape == (-(-n // 16), k // 32, 32, 16) and torch.equal(unpack_mma(packed, n), w)
    pad = torch.zeros(packed.shape[0] * 16, k, dtype=torch.int8)
    pad[:n] = w
    for tile, chunk, lane in ((0, 0, 0), (packed.shape[0] - 1, k // 32 - 1, 31), (0, k // 32 - 1, 13)):
        r, c = tile * 16 + lane // 4, chunk * 32 + (lane % 4) * 8
        want = torch.cat([pad[r, c:c + 4], pad[r + 8, c:c + 4], pad[r, c + 4:c + 8], pad[r + 8, c + 4:c + 8]])
        assert torch.equal(packed[tile, chunk, lane], want)


@needs_nvcc
def test_mma_build_issues_int8_mmas_on_fragment_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = W8A8GemvSpec(9, 200, 2080, warps=8, group=4, bias=True, act="gelu", pdl="early", mma=True,
                        name="probe_w8g_mma")
    art = build_cuda(w8a8_gemv, spec)
    src = (art.path / "kernel.cu").read_text()
    assert "m16n8k32.row.col.s32.s8.s8.s32" in src and "ld.global.nc.L1::no_allocate.v4" in src and "dp4a" not in src
    assert art.launch["grid"][0] == spec.tiles == 13 and art.launch["pdl"] is True
    wq = next(a for a in art.launch["args"] if a["name"] == "WQ")
    assert wq["shape"] == [13, 65, 32, 4] and spec.weight_shape() == (13, 65, 32, 16)
    assert "mma" in spec.key() and "mma" not in W8A8GemvSpec(1, 64, 512).key()
    with pytest.raises(ValueError, match="multiple of 32"):
        W8A8GemvSpec(1, 64, 528, mma=True)


@needs_nvcc
@pytest.mark.parametrize("mma", [False, True])
def test_int8_codes_out_take_the_output_scale(tmp_path, monkeypatch, mma):
    """``out="int8"``: Y is int8 codes at the static scale ``OS`` (the tile kernels' saturating requantisation)."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = W8A8GemvSpec(5, 100, 1056, bias=True, act="gelu", out="int8", mma=mma, name=f"probe_w8g_q8{mma}")
    art = build_cuda(w8a8_gemv, spec)
    args = {a["name"]: a for a in art.launch["args"]}
    assert set(args) == set(argument_names(spec)) and args["Y"]["dtype"] == "int8" and args["OS"]["shape"] == [2]
    assert "__saturatef" in (art.path / "kernel.cu").read_text()
    assert spec.key()["out"] == "int8" and "out" not in W8A8GemvSpec(1, 64, 512).key()
    with pytest.raises(ValueError, match="out"):
        W8A8GemvSpec(1, 64, 512, out="int4")


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_sparse_packing_keeps_the_chunks_that_hold_a_code(density):
    from sparta.templates.w8a8_gemv.spec import chunk_mask, pack_weight, unpack_weight
    spec = W8A8GemvSpec(3, 101, 1056, mma=True, sparse=True)
    g = torch.Generator().manual_seed(int(density * 10))
    keep = torch.rand(spec.tiles, 33, generator=g) < density
    w = torch.randint(-127, 128, (101, 1056), generator=g, dtype=torch.int8)
    w = w * keep.repeat_interleave(16, 0)[:101].repeat_interleave(32, 1)
    wq, table = pack_weight(spec, w)
    kept = int(keep.sum())
    assert torch.equal(chunk_mask(w), keep) and wq.shape == spec.weight_shape(kept) == (max(kept, 1), 32, 16)
    assert table.dtype == torch.int32 and table.numel() == spec.tiles + 1 + kept
    assert table[: spec.tiles + 1].tolist() == [0] + torch.cumsum(keep.sum(1), 0).tolist()
    assert torch.equal(unpack_weight(spec, wq, table), w)


@needs_nvcc
def test_sparse_build_reads_the_chunk_table(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = W8A8GemvSpec(3, 101, 1056, warps=4, group=2, bias=True, mma=True, sparse=True, name="probe_w8g_sparse")
    art = build_cuda(w8a8_gemv, spec)
    args = {a["name"]: a["shape"] for a in art.launch["args"]}
    assert set(args) == set(argument_names(spec)) and args["Tab"] == [None] and args["WQ"] == [None, 32, 4]
    assert "Tab_ptr[((int)blockIdx.x)]" in (art.path / "kernel.cu").read_text()
    with pytest.raises(ValueError, match="sparse"):
        W8A8GemvSpec(1, 64, 512, sparse=True)


def test_blocks_specs_say_what_they_read():
    """``bn``/``bk``: the GEMV over a dense bsr_linear int8 tile's blocks (one packed weight), for the mma kernel
    only; a block-sparse tile's GEMVs keep their chunk pack (``sparse``), so the two are refused together."""
    spec = W8A8GemvSpec(0, 100, 416, mma=True, rows=16, bn=64, bk=64)
    assert spec.blocks and spec.unit_k == 64 and spec.ctas == 2 * 4 and "Tab" not in argument_names(spec)
    assert W8A8GemvSpec(0, 100, 416, mma=True, rows=16, bn=32, bk=96).unit_k == 32
    plain = W8A8GemvSpec(0, 100, 416, mma=True, rows=16)
    assert "bn" not in plain.key() and spec.key()["bn"] == 64 and plain.ctas == plain.tiles
    for bad in (dict(mma=False, rows=0, m=4), dict(bn=24), dict(bk=48), dict(sparse=True)):
        with pytest.raises(ValueError, match="blocks"):
            W8A8GemvSpec(**{**dict(m=0, n=100, k=416, mma=True, rows=16, bn=64, bk=64), **bad})


@pytest.mark.parametrize("bn,bk", [(64, 64), (32, 32), (192, 128)])
def test_blocks_kernel_fragments_multiply_the_right_k(bn, bk):
    """The blocks kernel (every block of a dense tile in K order) emulated unit by unit with its own indices (rows g
    and g + 8 of the CTA's 16-row tile, the lane's 16 or 8 bytes of the unit, X's words at the same K, m16n8k32's
    fragment layout; rows past N and K past it as the tile's packing leaves them): equal to the exact int8 product."""
    from sparta.templates.bsr_linear.packing import pack_weight
    from sparta.templates.bsr_linear.spec import BsrSpec
    n, k, rows = 40 + bn, 3 * bk - 32, 9
    spec = W8A8GemvSpec(0, n, k, mma=True, rows=16, bn=bn, bk=bk)
    g = torch.Generator().manual_seed(bn)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    xq = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
    tile = BsrSpec(0, n, k, bn=bn, bk=bk, tm=64, warps_m=1, warps_n=bn // 16, dtype="int8")
    keep = torch.ones(tile.row_blocks, tile.k_blocks, dtype=torch.bool)
    wp, table = pack_weight(wq, tile, keep)
    words, xw = wp.view(torch.int32).reshape(wp.shape[0], bn, bk // 4), xq.view(torch.int32)
    uk = spec.unit_k

    def ints(word):        # an int32 word's four int8 codes
        return torch.tensor([word], dtype=torch.int32).view(torch.int8).long()

    y = torch.zeros(rows, n, dtype=torch.long)
    for cta in range(spec.ctas):
        slot, sub = divmod(cta, bn // 16)
        row, first, count = (int(v) for v in table[slot * 3: slot * 3 + 3])
        assert (row, first, count) == (slot, slot * tile.k_blocks, tile.k_blocks)    # what the kernel assumes
        acc = torch.zeros(16, 16, dtype=torch.long)               # W rows x X rows (two 8-row MMAs)
        for u in range(count * (bk // uk)):
            blk, c = first + u // (bk // uk), u % (bk // uk)
            kc = ((u // (bk // uk)) * bk + c * uk) // 4
            for s in range(uk // 32):
                a, b = torch.zeros(16, 32, dtype=torch.long), torch.zeros(32, 16, dtype=torch.long)
                for lane in range(32):
                    gg, t = divmod(lane, 4)
                    for half in range(2):
                        w0 = (c * uk + (uk // 4) * t + 8 * s) // 4           # the lane's word of row sub*16 + g (+8)
                        r = words[blk, sub * 16 + half * 8 + gg]
                        a[half * 8 + gg, 4 * t: 4 * t + 4] = ints(int(r[w0]))          # a0 / a1
                        a[half * 8 + gg, 16 + 4 * t: 20 + 4 * t] = ints(int(r[w0 + 1]))  # a2 / a3
                        x0 = kc + t * (uk // 16) + 2 * s
                        xr = half * 8 + gg
                        if xr < rows:
                            b[4 * t: 4 * t + 4, xr] = ints(int(xw[xr, x0])) if x0 * 4 < k else 0        # b0
                            b[16 + 4 * t: 20 + 4 * t, xr] = ints(int(xw[xr, x0 + 1])) if x0 * 4 < k else 0  # b1
                acc += a @ b
        col0 = row * bn + sub * 16
        for nl in range(16):
            if col0 + nl < n:
                y[:, col0 + nl] = acc[nl, :rows]
    assert torch.equal(y, xq.long() @ wq.long().T)


@needs_nvcc
@pytest.mark.parametrize("bk", [64, 32])
def test_blocks_build_reads_the_tiles_blocks(tmp_path, monkeypatch, bk):
    """A dense tile's blocks are read with no table (every block in K order): 16-byte loads for 64-K units."""
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = W8A8GemvSpec(0, 100, 416, warps=4, group=2, bias=True, act="relu", mma=True, rows=16, bn=64, bk=bk,
                        name="w8g_blocks")
    art = build_cuda(w8a8_gemv, spec)
    src = (art.path / "kernel.cu").read_text()
    assert ("ld.global.nc.L1::no_allocate.v4.b32" if bk == 64 else "ld.global.nc.L1::no_allocate.v2.b32") in src
    names = {a["name"] for a in art.launch["args"]}
    assert names >= {"WQ", "XQ"} and "Tab" not in names and "Tab_ptr" not in src and art.launch["grid"][0] == 8
