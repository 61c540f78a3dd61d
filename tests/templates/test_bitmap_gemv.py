"""The bitmap GEMV family without a GPU: packing and unpacking at odd shapes and densities 0..1 (and a hypothesis
property), the torch reference against the masked dense linear, an emulation of the kernel's data flow (the loads and
bit walk it does, on the packed tensors) against the reference, spec checks, the kernel module's fake, saved form and
op, and compile-only CUDA builds for sm_80 and sm_90."""

import json
import shutil
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparta.errors import SpartaError
from sparta.runtime.cuda import CudaRuntimeError
from sparta.templates.bitmap_gemv.spec import (BitmapGemvError, BitmapGemvSpec, BitmapPacked, bitmap_gemv_ref,
                                               bytes_floor, pack_bitmap, split_buffers, unpack)
from sparta.templates.epilogue_ref import activate

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
KNOBS = [dict(), dict(tile_rows=32, stream_cols=256), dict(tile_rows=16, stream_cols=512, warps=2),
         dict(tile_rows=8, stream_cols=128, rows=4, inflight=2)]


def weight_and_mask(n, k, density, dtype=torch.bfloat16, seed=0):
    """Random weights with no zero among them (a pruned element must not pass for a kept zero) and a random mask."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w = torch.where(w.abs() < 1e-3, torch.full_like(w, 0.5), w).to(dtype)
    return w, torch.rand(n, k, generator=g) < density


def masked(w, mask):
    return torch.where(mask, w, torch.zeros_like(w))


@pytest.mark.parametrize("density", [0.0, 0.1, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("n, k", [(77, 200), (130, 1000), (1, 8), (33, 1031)])
@pytest.mark.parametrize("knobs", KNOBS)
def test_pack_unpack_round_trip(n, k, density, knobs):
    spec = BitmapGemvSpec(n, k, **knobs)
    w, mask = weight_and_mask(n, k, density, seed=n + k)
    packed = pack_bitmap(w, mask, spec)
    dense, got_mask = unpack(packed, spec)
    assert torch.equal(got_mask, mask)
    assert torch.equal(dense, masked(w, mask))
    # only each stream's last piece is padded: value slots = sum over streams of ceil(kept / 8) * 8
    assert packed.values.numel() == int(packed.offsets[-1]) * 8
    assert packed.values.numel() - int(mask.sum()) < 8 * spec.tiles * 32
    assert packed.values.numel() >= int(mask.sum())


def test_a_two_of_four_mask_packs_without_padding():
    """2:4 sparsity is a 50% bitmap whose streams all hold stream_cols / 2 values: whole pieces, no padding, every lane
    the same count (1.125 bytes an element, as the 2:4 format with 2-bit indices)."""
    n, k = 64, 1024
    spec = BitmapGemvSpec(n, k)
    w, _ = weight_and_mask(n, k, 1.0)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(n, k // 4, 4, generator=g).argsort(-1)[..., :2]
    mask = torch.zeros(n, k // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).view(n, k)
    packed = pack_bitmap(w, mask, spec)
    assert packed.values.numel() == n * k // 2 and packed.nbytes() == n * k * 9 // 8 + 4 * (spec.tiles + 1)
    dense, got_mask = unpack(packed, spec)
    assert torch.equal(got_mask, mask) and torch.equal(dense, masked(w, mask))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 90), k=st.integers(1, 700), density=st.floats(0, 1), knob=st.integers(0, len(KNOBS) - 1),
       fp16=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_pack_unpack_property(n, k, density, knob, fp16, seed):
    knobs = KNOBS[knob]
    spec = BitmapGemvSpec(n, k, dtype="float16" if fp16 else "bfloat16", **knobs)
    w, mask = weight_and_mask(n, k, density, torch.float16 if fp16 else torch.bfloat16, seed)
    dense, got_mask = unpack(pack_bitmap(w, mask, spec), spec)
    assert torch.equal(got_mask, mask) and torch.equal(dense, masked(w, mask))


@pytest.mark.parametrize("knobs", KNOBS)
def test_the_torch_packing_path_packs_as_the_numpy_one(knobs):
    """What a GPU weight packs with (torch ops on its device), run here on the CPU: the same tensors."""
    from sparta.templates.bitmap_gemv.spec import _pack
    spec = BitmapGemvSpec(77, 1000, **knobs)
    for density in (0.0, 0.3, 1.0):
        w, mask = weight_and_mask(77, 1000, density, seed=int(density * 10))
        a, b = _pack(w, mask, spec, on_cpu=True), _pack(w, mask, spec, on_cpu=False)
        for name in ("bits", "offsets", "values"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (name, density)


def test_packs_a_llama_weight_in_seconds():
    spec = BitmapGemvSpec(11008, 4096)
    w, mask = weight_and_mask(11008, 4096, 0.5)
    t0 = time.perf_counter()
    packed = pack_bitmap(w, mask, spec)
    assert time.perf_counter() - t0 < 6.0
    floor = bytes_floor(11008, 4096, float(mask.float().mean()))
    assert floor <= packed.nbytes() < 1.08 * floor          # last-piece padding and the tile table only


@pytest.mark.parametrize("act", ["none", "relu", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_is_the_masked_linear(act, dtype):
    n, k = 77, 200
    spec = BitmapGemvSpec(n, k, rows=5, dtype="float16" if dtype == torch.float16 else "bfloat16", bias=True, act=act)
    w, mask = weight_and_mask(n, k, 0.4, dtype)
    bias = torch.randn(n).to(dtype)
    x = (torch.randn(2, 3, k) / k ** 0.5).to(dtype)
    got = bitmap_gemv_ref(x, pack_bitmap(w, mask, spec), spec, bias)
    want = activate(x.float() @ masked(w, mask).float().t() + bias.float(), act).to(dtype)
    assert got.shape == (2, 3, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(BitmapGemvError, match="bias"):
        bitmap_gemv_ref(x, pack_bitmap(w, mask, spec), spec)


def emulate(spec: BitmapGemvSpec, packed: BitmapPacked, x: torch.Tensor, bias=None) -> torch.Tensor:
    """The kernel's data flow in numpy (float64): per CTA its X staging (padded blocks), per warp tile the 16-byte
    bitmap load, the ballot-ranked piece addresses, the bit walk against the loaded values, then the lane, warp and
    split sums."""
    R, S, CS, WS, C = spec.tile_rows, spec.lanes_per_row, spec.stream_cols, spec.words, spec.tile_cols
    KT, NKT, W, IF = spec.range_tiles, spec.col_tiles, spec.warps, spec.inflight
    bits = packed.bits.reshape(-1).numpy().view(np.uint32)
    off, vals = packed.offsets.numpy(), packed.values.float().numpy().astype(np.float64)
    xm = x.float().numpy().astype(np.float64)
    m_rows = xm.shape[0]
    y = np.zeros((m_rows, spec.row_tiles * R))
    lanes = np.arange(32)
    for rt in range(spec.row_tiles):
        for ks in range(spec.ksplit):
            xs = np.zeros((m_rows, spec.x_stride))
            for b in range(KT * S):
                for u in range(CS):
                    col = ks * KT * C + b * CS + u
                    if col < spec.k:
                        xs[:, b * (CS + 8) + u] = xm[:, col]
            part = np.zeros((W, 32, m_rows))
            for w in range(W):
                for i in range(-(-KT // W)):
                    kl = w + i * W
                    if kl >= KT or ks * KT + kl >= NKT:
                        continue
                    tile = rt * NKT + ks * KT + kl
                    wd = np.array([[bits[((tile * (WS // 4) + q // 4) * 32 + lane) * 4 + q % 4] for q in range(WS)]
                                   for lane in lanes], dtype=np.uint64)
                    cnt = np.array([sum(bin(int(v)).count("1") for v in row) for row in wd])
                    pieces = (cnt + 7) // 8
                    loaded = np.zeros((32, -(-pieces.max() // IF) * IF * 8 if cnt.any() else 0))
                    before = 0
                    for j in range(loaded.shape[1] // 8):
                        ballot = pieces > j
                        rank = np.cumsum(ballot) - ballot
                        for lane in lanes[ballot]:
                            p = off[tile] + before + rank[lane]
                            loaded[lane, j * 8:(j + 1) * 8] = vals[p * 8:(p + 1) * 8]
                        before += int(ballot.sum())
                    for lane in lanes:
                        slot = 0
                        for q in range(WS):
                            word = int(wd[lane, q])
                            while word:                      # highest set bit first
                                b = word.bit_length() - 1
                                word ^= 1 << b
                                col = (kl * S + lane % S) * (CS + 8) + q * 32 + b
                                part[w, lane] += loaded[lane, slot] * xs[:, col]
                                slot += 1
                        assert slot == cnt[lane]
            rows = part.sum(0).reshape(R, S, m_rows).sum(1)          # lanes of a row, then warps
            y[:, rt * R:(rt + 1) * R] += rows.T
    y = y[:, :spec.n]
    if spec.bias:
        y = y + bias.float().numpy()
    return activate(torch.from_numpy(y).float(), spec.act)


@pytest.mark.parametrize("n, k, density, knobs", [
    (77, 200, 0.5, dict(rows=3, bias=True, act="gelu")),
    (45, 1031, 0.3, dict(rows=2, tile_rows=32, stream_cols=256, warps=2, inflight=2)),
    (33, 1500, 0.1, dict(rows=4, ksplit=2, warps=1, stream_cols=128)),
    (20, 600, 1.0, dict(rows=1, tile_rows=16, stream_cols=512, inflight=4)),
    (20, 300, 0.0, dict(rows=2, bias=True)),
])
def test_kernel_data_flow_gives_the_reference(n, k, density, knobs):
    spec = BitmapGemvSpec(n, k, **knobs)
    w, mask = weight_and_mask(n, k, density, seed=k)
    bias = torch.randn(n).bfloat16() if spec.bias else None
    packed = pack_bitmap(w, mask, spec)
    x = (torch.randn(spec.rows, k) / k ** 0.5).bfloat16()
    got = emulate(spec, packed, x, bias)
    want = bitmap_gemv_ref(x, packed, spec, bias).float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def emulate_mma(spec: BitmapGemvSpec, packed: BitmapPacked, x: torch.Tensor, bias=None) -> torch.Tensor:
    """The ``mma`` variant's data flow: each warp's dense tile filled by the bit walk, the fragments the kernel loads
    (``mma.py``) placed where PTX's m16n8k16 layout says they go, the product, D handed back to lanes by that layout
    and into the warps' sums as ``acc_to_red`` does."""
    C, KT, NKT, W = spec.tile_cols, spec.range_tiles, spec.col_tiles, spec.warps
    S, CS, WS, MRP = 2, spec.stream_cols, spec.words, spec.mma_rows
    dense, _ = unpack(packed, spec)
    bits = packed.bits.reshape(-1).numpy().view(np.uint32)
    xm = np.zeros((MRP, spec.k))
    xm[:x.shape[0]] = x.float().numpy()
    wp = np.zeros((spec.row_tiles * 16, NKT * C))
    wp[:spec.n, :spec.k] = dense.float().numpy()
    y = np.zeros((x.shape[0], spec.row_tiles * 16))
    g, t = np.arange(32) // 4, np.arange(32) % 4
    for rt in range(spec.row_tiles):
        for ks in range(spec.ksplit):
            xs = np.zeros((MRP, spec.x_stride))
            cols = min(KT * C, max(0, spec.k - ks * KT * C))
            xs[:, :cols] = xm[:, ks * KT * C: ks * KT * C + cols]
            red = np.zeros((W, 16, spec.rows))
            for w in range(W):
                acc = np.zeros((32, MRP // 8, 4))
                for kl in range(w, KT, W):
                    if ks * KT + kl >= NKT:
                        continue
                    tile = np.zeros((16, C))            # the walk: each lane's set bits, in its row and stream
                    for lane in range(32):
                        for q in range(WS):
                            word = int(bits[(((rt * NKT + ks * KT + kl) * (WS // 4) + q // 4) * 32 + lane) * 4 + q % 4])
                            for b in range(32):
                                if word >> b & 1:
                                    col = lane % S * CS + q * 32 + b
                                    tile[lane // S, col] = wp[rt * 16 + lane // S, (ks * KT + kl) * C + col]
                    for kk in range(C // 16):
                        a_regs = [(tile[g, kk * 16 + 2 * t], tile[g, kk * 16 + 2 * t + 1]),
                                  (tile[g + 8, kk * 16 + 2 * t], tile[g + 8, kk * 16 + 2 * t + 1]),
                                  (tile[g, kk * 16 + 2 * t + 8], tile[g, kk * 16 + 2 * t + 9]),
                                  (tile[g + 8, kk * 16 + 2 * t + 8], tile[g + 8, kk * 16 + 2 * t + 9])]
                        a = np.zeros((16, 16))                 # PTX: reg i of lane (g, t) -> A rows / columns
                        for i, (rows, c0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                                        (g + 8, 2 * t + 8))):
                            a[rows, c0], a[rows, c0 + 1] = a_regs[i]
                        for mh in range(MRP // 8):
                            xb = kl * C + kk * 16 + 2 * t
                            b_regs = [(xs[mh * 8 + g, xb], xs[mh * 8 + g, xb + 1]),
                                      (xs[mh * 8 + g, xb + 8], xs[mh * 8 + g, xb + 9])]
                            bm = np.zeros((16, 8))             # PTX: B reg 0 -> k 2t, 2t+1; reg 1 -> k + 8; n = g
                            bm[2 * t, g], bm[2 * t + 1, g] = b_regs[0]
                            bm[2 * t + 8, g], bm[2 * t + 9, g] = b_regs[1]
                            d = a @ bm                          # PTX: D regs -> (g, 2t), (g, 2t+1), (g+8, ...)
                            acc[:, mh] += np.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t],
                                                    d[g + 8, 2 * t + 1]], 1)
                for lane in range(32):                          # acc_to_red
                    for mh in range(MRP // 8):
                        for r in range(4):
                            m = mh * 8 + t[lane] * 2 + r % 2
                            if m < spec.rows:
                                red[w, g[lane] + r // 2 * 8, m] = acc[lane, mh, r]
            y[:, rt * 16:(rt + 1) * 16] += red.sum(0).T[:x.shape[0]]
    y = y[:, :spec.n]
    if spec.bias:
        y = y + bias.float().numpy()
    return activate(torch.from_numpy(y).float(), spec.act)


@pytest.mark.parametrize("n, k, density, knobs", [
    (40, 600, 0.5, dict(rows=3, bias=True, act="relu", stream_cols=128)),
    (20, 1031, 0.3, dict(rows=16, ksplit=2, warps=2, stream_cols=256, dtype="float16")),
    (17, 300, 1.0, dict(rows=9, warps=1, stream_cols=128)),
])
def test_mma_data_flow_gives_the_reference(n, k, density, knobs):
    spec = BitmapGemvSpec(n, k, tile_rows=16, mma=True, **knobs)
    dtype = torch.float16 if spec.dtype == "float16" else torch.bfloat16
    w, mask = weight_and_mask(n, k, density, dtype, seed=k)
    bias = torch.randn(n).to(dtype) if spec.bias else None
    packed = pack_bitmap(w, mask, spec)
    x = (torch.randn(spec.rows - 1 or 1, k) / k ** 0.5).to(dtype)
    torch.testing.assert_close(emulate_mma(spec, packed, x, bias), bitmap_gemv_ref(x, packed, spec, bias).float(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kw, words", [
    (dict(rows=17), "rows=17"),
    (dict(dtype="float32"), "dtype"),
    (dict(act="tanh"), "activation"),
    (dict(tile_rows=4), "tile_rows"),
    (dict(stream_cols=64), "stream_cols"),
    (dict(warps=3), "warps"),
    (dict(inflight=3), "inflight"),
    (dict(ksplit=0), "ksplit"),
    (dict(ksplit=99), "column tiles"),
    (dict(rows=16, k=11008), "shared memory"),
    (dict(n=0), "positive"),
    (dict(mma=True), "tile_rows=16"),
])
def test_bad_specs_are_refused_with_the_reason(kw, words):
    with pytest.raises(BitmapGemvError, match=words) as info:
        BitmapGemvSpec(**{"n": 64, "k": 4096, **kw})
    assert isinstance(info.value, SpartaError)


def test_pack_refuses_shapes_that_do_not_fit():
    spec = BitmapGemvSpec(64, 256)
    w, mask = weight_and_mask(64, 256, 0.5)
    with pytest.raises(BitmapGemvError, match="must be \\(N, K\\)"):
        pack_bitmap(w[:, :128], mask[:, :128], spec)
    packed = pack_bitmap(w, mask, spec)
    with pytest.raises(BitmapGemvError, match="do not match"):
        unpack(BitmapPacked(packed.bits, packed.offsets, packed.values[8:]), spec)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Three kernels: bf16 with PDL, one row; fp16 bias + SiLU, 4 rows, K split over 3 CTAs, no PDL, K % 8 != 0;
    tensor cores for 9 rows (two MMAs per 16 columns), K split over 2 CTAs."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from sparta.templates.bitmap_gemv.build import build_kernel
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARTA_CACHE", str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("kernels")
    specs = {"bm_one": BitmapGemvSpec(300, 1024, name="bm_one"),
             "bm_split": BitmapGemvSpec(77, 1203, rows=4, dtype="float16", bias=True, act="silu", ksplit=3, warps=2,
                                        pdl=False, name="bm_split"),
             "bm_mma": BitmapGemvSpec(77, 1024, rows=9, tile_rows=16, warps=2, ksplit=2, mma=True, name="bm_mma")}
    try:
        yield {name: (spec, build_kernel(spec, out)) for name, spec in specs.items()}
    finally:
        mp.undo()


@needs_nvcc
def test_builds_for_sm80_and_sm90(built):
    for name, (spec, folder) in built.items():
        launch = json.loads((folder / "launch.json").read_text())
        assert sorted(launch["cubins"]) == ["sm_80", "sm_90"] and bool(launch.get("pdl")) == spec.pdl
        assert launch["grid"] == [spec.row_tiles, spec.ksplit, 1] and launch["block"] == [32 * spec.warps, 1, 1]
        assert launch["shared_bytes"] == spec.shared_bytes
        args = {a["name"] for a in launch["args"]}
        passed = {"X", "Bits", "Off", "Vals", "Y"} | ({"B"} if spec.bias else set()) | set(split_buffers(spec, "cpu"))
        assert args == passed | {"M"}                          # what BitmapGemvOp passes, by name
        assert ({"P", "Cnt"} <= args) == (spec.ksplit > 1)
        src = (folder / "kernel.cu").read_text()
        assert "__ballot_sync" in src and "__clz" in src and "__reduce_max_sync" in src
        assert ("griddepcontrol.wait" in src) == spec.pdl and ("atomicAdd" in src) == (spec.ksplit > 1)
        mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
        assert src.count(mma + " ") == (1 if spec.mma else 0) and ("sparta_bm_sts16" in src) == spec.mma


@needs_nvcc
def test_module_packs_fakes_saves_and_refuses_cpu_inputs(built):
    from sparta.templates.bitmap_gemv.runtime import BitmapLinearCUDA
    spec, folder = built["bm_split"]
    w, mask = weight_and_mask(spec.n, spec.k, 0.3, torch.float16)
    bias = torch.randn(spec.n)
    module = BitmapLinearCUDA.from_weight(folder, w, mask, bias)
    assert module.spec == spec and module.split_Cnt.shape == (spec.row_tiles,) and not module.split_Cnt.any()
    assert torch.equal(module.dense_weight(), masked(w, mask))
    config, tensors, folders = module.saved_state()
    assert sorted(tensors) == ["bias", "bits", "offsets", "values"] and list(folders) == ["bm_split"]
    loaded = BitmapLinearCUDA.from_saved(json.loads(json.dumps(config)), tensors, folders)
    assert loaded.spec == spec and torch.equal(loaded.values, module.values)
    x = torch.randn(2, 2, spec.k).half()
    rows = x.view(4, spec.k)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        y, = torch.ops.sparta.bitmap_gemv(module.kernel_key, [mode.from_tensor(rows)],
                                          [mode.from_tensor(t) for t in module.kernel_weights()])
    assert y.shape == (4, spec.n) and y.dtype == torch.float16
    with pytest.raises(CudaRuntimeError, match="CUDA"):
        module(x)
    with pytest.raises(BitmapGemvError, match="bias"):
        BitmapLinearCUDA.from_weight(folder, w, mask, None)
    other, _ = built["bm_one"]
    with pytest.raises(BitmapGemvError, match="bits must be"):
        BitmapLinearCUDA(folder, spec, pack_bitmap(*weight_and_mask(other.n, other.k, 0.5), other), bias)
