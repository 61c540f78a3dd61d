"""The 2:4 sparse linear family without a GPU: packing and unpacking at odd shapes (2:4, 1:4 and 0:4 groups, all-zero
and fully 2:4 weights, a hypothesis property), the torch reference against the masked dense linear, an independent
emulation of ``mma.sp`` m16n8k32 from PTX's fragment layouts fed the packed fragments and the kernel's staged X,
refusals with the family's error, the kernel module's fake, saved form and op, and compile-only CUDA builds for sm_80
and sm_90."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fixtures.cuda_specs_nm_linear import fixture_specs

from sparta.errors import SpartaError
from sparta.runtime.cuda import CudaRuntimeError
from sparta.templates.epilogue_ref import activate
from sparta.templates.nm_linear.spec import (NmLinearError, NmLinearSpec, NmPacked, bytes_floor, check_two_four,
                                             nm_linear_ref, pack_nm, split_buffers, unpack)

DT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def two_four(n, k, dtype=torch.bfloat16, seed=0, keep=(0, 1, 2)):
    """A random weight with no zero among its values and a mask keeping a random count in ``keep`` of each group of
    4 (the last, partial group of a K not a multiple of 4 included)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w = torch.where(w.abs() < 1e-3, torch.full_like(w, 0.5), w).to(dtype)
    kp = -(-k // 4) * 4
    order = torch.rand(n, kp // 4, 4, generator=g).argsort(-1)
    choice = torch.tensor(keep)[torch.randint(len(keep), (n, kp // 4, 1), generator=g)]
    mask = torch.zeros(n, kp // 4, 4, dtype=torch.bool).scatter_(-1, order, torch.arange(4).expand(n, kp // 4, 4)
                                                                 < choice)
    return w, mask.view(n, kp)[:, :k].contiguous()


def masked(w, mask):
    return torch.where(mask, w, torch.zeros_like(w))


# ---- an independent emulation of one mma.sp m16n8k32 (PTX ISA's fragment layouts) -------------------------------
LANE = torch.arange(32)
GID, TIG = LANE // 4, LANE % 4          # groupID, threadID_in_group


def mma_sp(a: torch.Tensor, b: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """D (T, 32, 4) of ``T`` sparse MMAs m16n8k32 (selector 0) from each lane's A elements a0..a7 (T, 32, 8), B
    elements b0..b7 (T, 32, 8) and metadata word (T, 32), in float64. A's compressed 16 × 16 fragment as dense
    m16n8k16's: row groupID (a0, a1, a4, a5) or groupID + 8, column 2·tig + (i & 1) (+ 8 for i >= 4); compressed
    column 2c + j is the j-th kept element of group c. Metadata: lanes tig 0 and 1 of a quad; bits 0..15 row
    groupID's groups 4·tig .. 4·tig + 3, bits 16..31 row groupID + 8's, a nibble a group (first index low).
    B: row 2·tig + (i & 1) + 8·(i >> 1), column groupID. D: row groupID (+ 8 for d2, d3), column 2·tig + (i & 1)."""
    T = a.shape[0]
    comp = torch.zeros(T, 16, 16, dtype=torch.float64)
    for i in range(8):
        row = GID + (8 if i in (2, 3, 6, 7) else 0)
        comp[:, row, 2 * TIG + (i & 1) + (8 if i >= 4 else 0)] = a[:, :, i].double()
    nib = torch.full((T, 16, 8), -1, dtype=torch.int64)
    for lane in range(32):
        gid, tig = lane // 4, lane % 4
        if tig >= 2:
            continue
        word = e[:, lane].to(torch.int64) & 0xFFFFFFFF
        for c in range(4):
            nib[:, gid, 4 * tig + c] = (word >> (4 * c)) & 0xF
            nib[:, gid + 8, 4 * tig + c] = (word >> (16 + 4 * c)) & 0xF
    i0, i1 = nib & 3, nib >> 2
    assert (nib >= 0).all() and (i0 < i1).all(), "metadata: a group's indices must differ and increase"
    dense = torch.zeros(T, 16, 8, 4, dtype=torch.float64)
    dense.scatter_(-1, torch.stack([i0, i1], -1), comp.view(T, 16, 8, 2))
    bm = torch.zeros(T, 32, 8, dtype=torch.float64)
    for i in range(8):
        bm[:, 2 * TIG + (i & 1) + 8 * (i >> 1), GID] = b[:, :, i].double()
    d = dense.view(T, 16, 32) @ bm
    return torch.stack([d[:, GID + (8 if i >= 2 else 0), 2 * TIG + (i & 1)] for i in range(4)], -1)


def staged_x(x: torch.Tensor, spec: NmLinearSpec) -> torch.Tensor:
    """X as the kernel stages it in shared memory (rows ``x_rows``, the padded K): column ``8j + 2t + e`` of each
    32-column block at ``8t + 2j + e``."""
    m = x.shape[0]
    xs = torch.zeros(spec.x_rows, spec.k_pad, dtype=x.dtype)
    xs[:m, :spec.k] = x
    p = torch.arange(spec.k_pad)
    kk = p % 32
    dst = p // 32 * 32 + kk % 8 // 2 * 8 + kk // 8 * 2 + kk % 2
    out = torch.zeros_like(xs)
    out[:, dst] = xs
    return out


def emulate(spec: NmLinearSpec, packed: NmPacked, x: torch.Tensor) -> torch.Tensor:
    """Y (M, N) in float64 of the kernel's data flow: per row tile and K tile, each lane's 16-byte A fragment, its
    metadata word (metadata lane 2·groupID + tig % 2 of the tile's group), its 16-byte B fragment from the staged X at
    row min(8·nb + groupID, rows - 1), column 32·kt + 8·tig, into :func:`mma_sp`; D summed over K tiles and
    scattered to Y."""
    RT, KT, G = spec.row_tiles, spec.k_tiles, spec.groups
    a = packed.values.reshape(RT * KT, 32, 8)
    meta = packed.meta.view(RT, G, 16, 4).permute(0, 1, 3, 2).reshape(RT * KT, 16)
    e = meta[:, GID * 2 + TIG % 2]
    xs = staged_x(x, spec)
    y = torch.zeros(8 * spec.mmas, RT * 16, dtype=torch.float64)
    for nb in range(spec.mmas):
        cols = (torch.arange(KT)[:, None, None] * 32 + TIG[None, :, None] * 8 + torch.arange(8)[None, None, :])
        b = xs[(nb * 8 + GID[None, :, None]).clamp(max=spec.x_rows - 1), cols]  # (KT, 32, 8); past the rows: the last
        b = b[None].expand(RT, KT, 32, 8).reshape(RT * KT, 32, 8)
        d = mma_sp(a, b, e).view(RT, KT, 32, 4).sum(1)                         # (RT, 32, 4)
        for i in range(4):
            rows = nb * 8 + 2 * TIG + (i & 1)
            chans = torch.arange(RT)[:, None] * 16 + GID[None, :] + (8 if i >= 2 else 0)
            y[rows[None, :].expand(RT, 32), chans] = d[:, :, i]
    return y[:x.shape[0], :spec.n]


# ---- packing ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n, k", [(77, 200), (16, 128), (33, 1000), (1, 32), (130, 4096), (5, 7)])
def test_pack_unpack_round_trip(n, k, dtype):
    spec = NmLinearSpec(n, k, dtype=dtype)
    w, mask = two_four(n, k, DT[dtype], seed=n + k)
    packed = pack_nm(w, spec, mask)
    dense, kept = unpack(packed, spec)
    assert torch.equal(dense, masked(w, mask)) and torch.equal(kept, mask)
    assert packed.values.shape == (spec.row_tiles, spec.k_tiles, 32, 8)
    assert packed.nbytes() == spec.row_tiles * 16 * spec.k_pad * 9 // 8
    assert torch.equal(unpack(pack_nm(masked(w, mask), spec), spec)[0], dense)     # the mask from the nonzeros


@pytest.mark.parametrize("keep", [(1,), (0,), (0, 1), (2,)])
def test_one_four_zero_four_and_full_two_four_groups(keep):
    spec = NmLinearSpec(48, 384, rows=5)
    w, mask = two_four(48, 384, seed=sum(keep) + len(keep), keep=keep)
    assert int(mask.view(48, -1, 4).sum(-1).max()) == max(keep)
    packed = pack_nm(w, spec, mask)
    dense, kept = unpack(packed, spec)
    assert torch.equal(dense, masked(w, mask)) and torch.equal(kept, mask)
    x = torch.randn(5, 384).bfloat16()
    want = x.double() @ masked(w, mask).double().t()
    torch.testing.assert_close(emulate(spec, packed, x), want, rtol=1e-9, atol=1e-9)


def test_all_zero_weight_packs_to_zero_values_and_valid_metadata():
    spec = NmLinearSpec(20, 96, rows=3)
    packed = pack_nm(torch.zeros(20, 96, dtype=torch.bfloat16), spec)
    assert not packed.values.any()
    assert (packed.meta == 0x44444444).all()           # indices 0 and 1 in every group
    dense, kept = unpack(packed, spec)
    assert not dense.any() and not kept.any()
    assert not emulate(spec, packed, torch.randn(3, 96).bfloat16()).any()


def test_pack_on_the_weights_dtype_and_fp32_weights():
    spec = NmLinearSpec(40, 256, dtype="float16")
    w, mask = two_four(40, 256, torch.float32, seed=3)
    packed = pack_nm(w, spec, mask)
    assert packed.values.dtype == torch.float16
    assert torch.equal(unpack(packed, spec)[0], masked(w, mask).half())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 600), fp16=st.booleans(), seed=st.integers(0, 2 ** 16),
       rows=st.integers(1, 20))
def test_packing_is_sound_property(n, k, fp16, seed, rows):
    """Any 2:4 mask packs to fragments that unpack to the masked weight and that the emulated sparse MMAs multiply
    into the masked linear."""
    dtype = torch.float16 if fp16 else torch.bfloat16
    spec = NmLinearSpec(n, k, rows=rows, dtype="float16" if fp16 else "bfloat16")
    w, mask = two_four(n, k, dtype, seed)
    packed = pack_nm(w, spec, mask)
    dense, kept = unpack(packed, spec)
    assert torch.equal(dense, masked(w, mask)) and torch.equal(kept, mask)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, k, generator=g).to(dtype)
    want = x.double() @ masked(w, mask).double().t()
    torch.testing.assert_close(emulate(spec, packed, x), want, rtol=1e-9, atol=1e-9)


# ---- the metadata layout against the emulated MMA ----------------------------------------------------------------
@pytest.mark.parametrize("n, k, rows", [(16, 32, 8), (77, 200, 3), (130, 1000, 16), (33, 512, 24), (48, 256, 64)])
def test_packed_fragments_through_the_emulated_mma_give_w_x(n, k, rows):
    spec = NmLinearSpec(n, k, rows=rows, ksplit=1)
    w, mask = two_four(n, k, seed=7 * n + k)
    packed = pack_nm(w, spec, mask)
    x = torch.randn(rows, k).bfloat16()
    want = x.double() @ masked(w, mask).double().t()
    torch.testing.assert_close(emulate(spec, packed, x), want, rtol=1e-9, atol=1e-9)


def test_a_wrong_layout_is_caught_by_the_emulation():
    """The emulation is not vacuous: swapping the two metadata halves (rows g and g + 8) or the lanes' registers
    changes Y."""
    spec = NmLinearSpec(32, 256, rows=8)
    w, mask = two_four(32, 256, seed=11, keep=(2,))
    packed = pack_nm(w, spec, mask)
    x = torch.randn(8, 256).bfloat16()
    want = x.double() @ masked(w, mask).double().t()
    word = packed.meta.to(torch.int64) & 0xFFFFFFFF
    swapped = ((word >> 16) | ((word & 0xFFFF) << 16))
    bad_meta = torch.where(swapped >= 2 ** 31, swapped - 2 ** 32, swapped).to(torch.int32)
    assert not torch.allclose(emulate(spec, NmPacked(packed.values, bad_meta), x), want)
    bad_vals = packed.values[..., [2, 3, 0, 1, 6, 7, 4, 5]].contiguous()
    assert not torch.allclose(emulate(spec, NmPacked(bad_vals, packed.meta), x), want)


# ---- reference and refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["none", "relu", "gelu", "silu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reference_is_the_masked_linear(act, dtype):
    spec = NmLinearSpec(70, 260, rows=4, dtype=dtype, bias=True, act=act)
    w, mask = two_four(70, 260, DT[dtype], seed=5)
    bias = torch.randn(70).to(DT[dtype])
    x = torch.randn(2, 4, 260).to(DT[dtype])
    got = nm_linear_ref(x, pack_nm(w, spec, mask), spec, bias)
    want = activate(x.float() @ masked(w, mask).float().t() + bias.float(), act).to(DT[dtype])
    assert got.shape == (2, 4, 70) and got.dtype == DT[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_a_mask_that_is_not_two_four_is_refused():
    spec = NmLinearSpec(16, 64)
    w, mask = two_four(16, 64)
    mask[3, 8:11] = True                                # three kept in the group 8..11 of row 3
    with pytest.raises(NmLinearError, match="not 2:4.*row 3, columns 8..11") as info:
        pack_nm(w, spec, mask)
    assert isinstance(info.value, SpartaError)
    with pytest.raises(NmLinearError, match="not 2:4"):
        pack_nm(torch.ones(16, 64), spec)               # a dense weight without a mask
    with pytest.raises(NmLinearError, match="not 2:4"):
        check_two_four(torch.ones(2, 7, dtype=torch.bool))
    check_two_four(torch.tensor([[True, True, False, False, True, True]]))


def test_bad_weights_and_packed_tensors_are_refused():
    spec = NmLinearSpec(16, 64)
    w, mask = two_four(16, 64)
    with pytest.raises(NmLinearError, match="must be \\(N, K\\)"):
        pack_nm(w[:, :32], spec, mask[:, :32])
    with pytest.raises(NmLinearError, match="fp16, bf16 or fp32"):
        pack_nm(torch.zeros(16, 64, dtype=torch.int32), spec)
    with pytest.raises(NmLinearError, match="bool"):
        pack_nm(w, spec, mask.int())
    packed = pack_nm(w, spec, mask)
    with pytest.raises(NmLinearError, match="not the spec"):
        unpack(NmPacked(packed.values[:, :2], packed.meta), spec)
    bad = packed.meta.clone()
    bad[0, 0, 0, 0] = 0x5                               # indices 1 and 1: invalid
    with pytest.raises(NmLinearError, match="increasing"):
        unpack(NmPacked(packed.values, bad), spec)


@pytest.mark.parametrize("kw, words", [
    (dict(dtype="float32"), "dtype"),
    (dict(rows=0), "rows"),
    (dict(rows=65), "rows"),
    (dict(warps=3), "warps"),
    (dict(inflight=2), "inflight"),
    (dict(ksplit=0), "ksplit"),
    (dict(ksplit=99), "groups"),
    (dict(rows=64, k=11008), "shared memory"),
    (dict(n=0), "positive"),
    (dict(act="tanh"), "activation"),
    (dict(tiles=3), "tiles"),
    (dict(tiles=4, warps=2), "multiple of tiles"),
    (dict(prefetch=1), "prefetch"),
])
def test_bad_specs_are_refused_with_the_reason(kw, words):
    with pytest.raises(NmLinearError, match=words) as info:
        NmLinearSpec(**{"n": 64, "k": 4096, **kw})
    assert isinstance(info.value, SpartaError)


def test_geometry_and_bytes():
    spec = NmLinearSpec(4096, 11008, rows=16, ksplit=4)
    assert spec.groups == 86 and spec.k_pad == 11008 and spec.range_groups == 22 and spec.mmas == 2
    assert spec.x_stride % 64 == 32                     # rows 64 bytes apart modulo 128
    assert bytes_floor(4096, 4096) == 4096 * 4096 * 9 / 8
    assert split_buffers(spec, "cpu")["P"].shape == (4, 16, 4096)
    assert split_buffers(NmLinearSpec(64, 256), "cpu") == {}
    tiled = NmLinearSpec(300, 4096, rows=16, warps=8, tiles=8, ksplit=2)
    assert tiled.cta_rows == 3 and tiled.tile_warps == 1 and tiled.shared_bytes == spec.__class__(
        300, 4096, rows=16, warps=8, ksplit=2).shared_bytes          # X is staged once a CTA, whatever its tiles
    assert split_buffers(tiled, "cpu")["Cnt"].shape == (tiled.row_tiles,)


def work_split(spec: NmLinearSpec):
    """The kernel's index math (kernel.py) replayed in Python: which (row tile, K tile) each (CTA, warp) multiplies,
    and, per output (row, channel) of a CTA, the ``red`` rows its reduction sums."""
    TL, WT, NBT, IF, RG = spec.tiles, spec.tile_warps, spec.batches, spec.inflight, spec.range_groups
    done, red_rows = [], {}
    for rtg in range(spec.cta_rows):
        for ks in range(spec.ksplit):
            for warp in range(spec.warps):
                wi, rt = warp // TL, rtg * TL + warp % TL
                if rt >= spec.row_tiles:
                    continue
                for i in range(-(-NBT // WT)):
                    b = wi + i * WT
                    if b >= NBT:
                        continue
                    for gi in range(IF // 4):
                        if b * (IF // 4) + gi < RG and ks * RG + b * (IF // 4) + gi < spec.groups:
                            done += [(rt, (ks * RG + b * (IF // 4) + gi) * 4 + q, warp, rtg) for q in range(4)]
            CH = 16 * TL
            for o in range(CH * spec.rows):
                n = rtg * CH + o % CH
                if n < spec.n:      # red row w * CH + o % CH = (warp w * TL + tile) * 16 + channel
                    red_rows[(o // CH, n)] = [((w * CH + o % CH) // 16, rtg) for w in range(WT)]
    return done, red_rows


@pytest.mark.parametrize("kw", [dict(n=130, k=1000, rows=16, ksplit=3, warps=4, inflight=4, tiles=4),
                                dict(n=333, k=520, rows=8, warps=4, inflight=4, tiles=2, prefetch=True),
                                dict(n=1000, k=2056, warps=8, tiles=8), dict(n=300, k=4096, rows=16, warps=8,
                                                                            tiles=8, ksplit=2, prefetch=True),
                                dict(n=64, k=256, warps=8, tiles=2, inflight=4)])
def test_tiles_cover_every_row_and_k_tile_once_and_reduce_their_own_warps(kw):
    spec = NmLinearSpec(**kw)
    done, red_rows = work_split(spec)
    pairs = [(rt, kt) for rt, kt, _, _ in done]
    assert sorted(pairs) == [(rt, kt) for rt in range(spec.row_tiles) for kt in range(spec.k_tiles)]
    multiplied = {}
    for rt, _, warp, rtg in done:
        multiplied.setdefault(rt, set()).add((warp, rtg))
    for (row, n), summed in red_rows.items():
        # the reduction of channel n sums its own CTA's warps of n's row tile: every one that multiplied it (a warp
        # without a batch adds its zeros), none of another tile
        assert multiplied[n // 16] <= set(summed), (row, n)
        assert all(warp % spec.tiles == n // 16 % spec.tiles and rtg == n // 16 // spec.tiles
                   for warp, rtg in summed), (row, n)


# ---- TVM and nvcc ----------------------------------------------------------------------------------------------
FIXTURES = {**fixture_specs(),                          # the GPU fixtures, and a few more
            "nm_kodd_r9_w1": NmLinearSpec(65, 203, rows=9, act="silu", inflight=16, warps=1),
            "nm_7b_r1": NmLinearSpec(4096, 11008, rows=1, warps=8, inflight=16),
            "nm_7b_r64_ks16": NmLinearSpec(4096, 11008, rows=64, warps=2, inflight=16, ksplit=16)}


@pytest.mark.parametrize("name", list(FIXTURES))
def test_the_tir_lowers_to_cuda_source_and_a_launch_spec(name):
    """TVM's CUDA source and launch spec (no nvcc): the sparse MMA, PDL and split K where asked, and exactly the
    arguments the runtime passes (no size computed on the host)."""
    pytest.importorskip("tvm")
    from sparta.codegen.cuda_build import _lower, coherent_params
    from sparta.templates.nm_linear.kernel import nm_linear
    spec = FIXTURES[name]
    src, launch = _lower(nm_linear(spec), spec.name)
    src = coherent_params(src) if spec.pdl else src
    op = "bf16" if spec.dtype == "bfloat16" else "f16"
    assert src.count(f"mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.{op}.{op}.f32 ") == 1
    assert ("griddepcontrol.wait" in src) == spec.pdl and ("atomicAdd" in src) == (spec.ksplit > 1)
    assert ("__restrict__" in src) != spec.pdl
    passed = {"X", "Vals", "Meta", "Y"} | ({"B"} if spec.bias else set()) | set(split_buffers(spec, "cpu"))
    assert {a["name"] for a in launch["args"]} == passed | {"M"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two kernels: bf16 with PDL, 3 rows, bias + GELU; fp16 for 16 rows (two MMAs a K tile), K split over 3 CTAs,
    no PDL, K % 8 != 0."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    pytest.importorskip("tvm")
    from sparta.templates.nm_linear.build import build_kernel
    mp = pytest.MonkeyPatch()
    mp.setenv("SPARTA_CACHE", str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("kernels")
    specs = {"nm_one": NmLinearSpec(77, 200, rows=3, bias=True, act="gelu", name="nm_one"),
             "nm_split": NmLinearSpec(130, 1003, rows=16, dtype="float16", ksplit=3, warps=2, pdl=False,
                                      name="nm_split"),
             "nm_tiled": NmLinearSpec(300, 2048, rows=16, warps=8, tiles=4, ksplit=2, prefetch=True,
                                      name="nm_tiled")}
    try:
        yield {name: (spec, build_kernel(spec, out)) for name, spec in specs.items()}
    finally:
        mp.undo()


def test_builds_for_sm80_and_sm90(built):
    for name, (spec, folder) in built.items():
        launch = json.loads((folder / "launch.json").read_text())
        assert sorted(launch["cubins"]) == ["sm_80", "sm_90"] and bool(launch.get("pdl")) == spec.pdl
        assert launch["grid"] == [spec.cta_rows, spec.ksplit, 1] and launch["block"] == [32 * spec.warps, 1, 1]
        assert launch["shared_bytes"] == spec.shared_bytes
        args = {a["name"] for a in launch["args"]}
        passed = {"X", "Vals", "Meta", "Y"} | ({"B"} if spec.bias else set()) | set(split_buffers(spec, "cpu"))
        assert args == passed | {"M"}                   # what NmLinearOp passes, by name


def test_module_packs_fakes_saves_and_refuses_cpu_inputs(built):
    from sparta.templates.nm_linear.runtime import NmLinearCUDA
    spec, folder = built["nm_split"]
    w, mask = two_four(spec.n, spec.k, torch.float16)
    module = NmLinearCUDA.from_weight(folder, w, None, rows=16, mask=mask)
    assert module.spec == spec and module.split_Cnt.shape == (spec.row_tiles,) and not module.split_Cnt.any()
    assert torch.equal(module.dense_weight(), masked(w, mask))
    config, tensors, folders = module.saved_state()
    assert sorted(tensors) == ["meta", "values"] and list(folders) == ["nm_split"]
    loaded = NmLinearCUDA.from_saved(json.loads(json.dumps(config)), tensors, folders)
    assert loaded.spec == spec and torch.equal(loaded.values, module.values)
    x = torch.randn(2, 3, spec.k).half()
    rows = x.view(6, spec.k)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        y, = torch.ops.sparta.nm_linear(module.kernel_key, [mode.from_tensor(rows)],
                                        [mode.from_tensor(t) for t in module.kernel_weights()])
    assert y.shape == (6, spec.n) and y.dtype == torch.float16
    with pytest.raises(CudaRuntimeError, match="CUDA"):
        module(x)
    with pytest.raises(NmLinearError, match="17"):
        NmLinearCUDA.from_weight(folder, w, None, rows=17, mask=mask)
    with pytest.raises(NmLinearError, match="without a bias"):
        NmLinearCUDA.from_weight(folder, w, torch.randn(spec.n), mask=mask)
    other, _ = built["nm_one"]
    with pytest.raises(NmLinearError, match="values must be"):
        NmLinearCUDA(folder, spec, pack_nm(*two_four(other.n, other.k)[:1], other, two_four(other.n, other.k)[1]))


# ---- selection: tiling by shape and the row buckets ---------------------------------------------------------------
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1024, 1024), (77, 200),
          (65, 203), (32000, 4096), (128, 8192)]


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("sms", [132, 108, 16])
def test_nm_tiling_gives_valid_knobs_for_every_rows(n, k, sms):
    from sparta.templates.nm_linear.select import KERNEL_ROWS, nm_tiling
    prev = None
    for rows in range(1, 65):
        t = nm_tiling(n, k, rows, sms)
        assert set(t) == {"rows", "warps", "inflight", "ksplit", "tiles", "prefetch"}
        assert t["rows"] == next(b for b in KERNEL_ROWS if b >= rows)
        spec = NmLinearSpec(n, k, **t)                   # every knob valid (raises otherwise)
        assert spec.batches >= 1 and spec.ksplit <= spec.groups
        if prev is not None and prev["rows"] == t["rows"]:
            assert prev == t, "one bucket, one kernel"
        if prev is not None and t["rows"] > 8 and prev["rows"] > 8 and t["tiles"] == prev["tiles"]:
            assert t["ksplit"] >= prev["ksplit"], "more rows: X takes more shared memory, K splits no less"
        prev = t


def test_nm_tiling_splits_longer_k_more_and_fills_the_sms():
    from sparta.templates.nm_linear.select import nm_tiling
    for rows in (1, 8, 16, 64):
        splits = [nm_tiling(4096, k, rows, 132)["ksplit"] for k in (1024, 4096, 11008, 14336, 28672)]
        assert splits == sorted(splits), (rows, splits)
    small = nm_tiling(128, 8192, 1, 132)                 # 8 row tiles: K split until the SMs have a CTA each
    assert 8 * small["ksplit"] >= 64 and small["ksplit"] <= 64


def test_nm_tiling_picks_the_measured_best_at_llama_7b_shapes():
    """benchmarks/RESULTS.md, "CUDA 2:4 sparse GEMV" (the H200 runs' best per case)."""
    from sparta.templates.nm_linear.select import nm_tiling
    pick = {(n, k, r): (t["warps"], t["inflight"], t["ksplit"], t["tiles"], t["prefetch"])
            for n, k in [(4096, 4096), (11008, 4096), (4096, 11008)] for r in (1, 8, 16)
            for t in [nm_tiling(n, k, r, 132)]}
    assert pick == {(4096, 4096, 1): (8, 8, 1, 1, False), (4096, 4096, 8): (8, 8, 1, 1, False),
                    (4096, 4096, 16): (8, 8, 4, 4, True), (11008, 4096, 1): (8, 8, 1, 1, False),
                    (11008, 4096, 8): (8, 8, 1, 1, False), (11008, 4096, 16): (8, 8, 4, 4, True),
                    (4096, 11008, 1): (4, 16, 2, 1, False), (4096, 11008, 8): (8, 8, 4, 4, True),
                    (4096, 11008, 16): (8, 8, 4, 4, True)}


def test_nm_rows_buckets():
    from sparta.passes.transform.nm import NM_MAX_ROWS
    from sparta.templates.nm_linear.select import KERNEL_ROWS, nm_kernel_rows, nm_rows_buckets
    buckets = nm_rows_buckets()
    assert buckets[0] == 1 and list(buckets) == sorted(set(buckets)) and set(buckets) <= set(KERNEL_ROWS)
    assert buckets[-1] == NM_MAX_ROWS, "the largest bucket is where the plan switches to the dense GEMM"
    assert [nm_kernel_rows(r) for r in (1, 2, 8, 9, 16, 17, 64)] == [1, 8, 8, 16, 16, 32, 64]
    with pytest.raises(NmLinearError, match="rows"):
        nm_kernel_rows(65)
