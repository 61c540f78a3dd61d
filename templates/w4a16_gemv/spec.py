"""W4A16 small-batch linear ``Y = X · dequant(W)ᵀ (+ b)`` for CUDA (Hopper): spec, weight layout, reference.

``X`` is ``(M, K)`` fp16 with ``M`` = 1..16 (decode / small batch; ``m=0``: M is a kernel argument, up to ``rows``), ``W`` is ``(N, K)`` int4 with one
fp16 scale per ``group`` (32/64/128) consecutive K of a row, symmetric (zero point 8) or asymmetric
(a zero point per group). ``Y`` is ``(M, N)`` fp16. Memory-bound: the kernel streams the weights once.

Layout (``pack_weight``): N in tiles of 8 rows, K in chunks of 128. ``Wq[tile, chunk, lane, 4]`` int32:
lane ``l = 4g + t`` holds row ``8·tile + g``, K ``128·chunk + 32t .. +32`` as four 32-bit words of 8
nibbles, interleaved (element ``e`` of a word at nibble ``[0, 4, 1, 5, 2, 6, 3, 7][e]``) so one
``lop3.b32`` ORs two nibbles into the mantissas of fp16 1024 (0x64006400): a half2 ``1024 + q``
(or ``1024 + 16q`` for the high nibbles). One ``sub.f16x2`` (``fma.rn.f16x2`` with 1/16 for the high
nibbles) subtracts ``1024 + zero`` exactly and one ``mul.f16x2`` applies the scale. A warp reads
512 contiguous bytes per tile and chunk (16-byte ``ld.global.nc.L1::no_allocate``). Scales
``S[tile, group, 8]`` fp16, zero points ``Z[tile, group, 8]`` uint8.

This module is the TVM-free side: spec, packing, dequantisation and the torch reference; the kernel is
``kernel.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

ORDER = (0, 4, 1, 5, 2, 6, 3, 7)   # nibble position of element e of a word (AWQ's interleave)
KCHUNK = 128                        # K per chunk: 4 lanes x 32 K of one row


@dataclass(frozen=True)
class W4A16Spec:
    """Shape, quantisation and tiling of one kernel."""
    m: int                           # 0: any number of rows up to ``rows`` (M a kernel argument)
    n: int
    k: int
    group: int = 128
    sym: bool = True                 # zero point 8; else a uint8 zero point per group
    bias: bool = False
    acc: str = "float32"             # mma accumulator: "float32" or "float16"
    ntile: int = 2                   # 8-row tiles of W per CTA (each warp does all of them)
    warps: int = 4                   # warps per CTA, splitting K
    unroll: int = 2                  # K chunks in flight per warp
    fold: bool = False               # scale folded into the fp32 sum per chunk (group 128 only)
    ksplit: int = 1                  # CTAs splitting K per row block (the last to finish sums their partials)
    min_ctas: int = 0                # > 0: __launch_bounds__(threads, min_ctas), registers capped to fit them per SM
    pdl: str = ""                    # programmatic dependent launch (sm_90), "early" or "late": see the module doc
    dtype: str = "float16"           # X, scales, bias and Y: "float16", or "bfloat16" (bf16 MMA, bf16x2 dequantisation)
    rows: int = 0                    # m=0: the most rows a call may have (1..16); sizes registers and shared memory
    name: str = "w4a16_gemv"

    def __post_init__(self):
        bad = []
        if self.m == 0 and not 1 <= self.rows <= 16:
            bad.append(f"rows={self.rows}: a kernel for any M (m=0) takes up to 1..16 rows")
        elif self.m and (not 1 <= self.m <= 16 or self.rows not in (0, self.m)):
            bad.append(f"M={self.m} must be 1..16 (small batch), rows 0 or M")
        if self.n <= 0 or self.k <= 0:
            bad.append("N and K must be positive")
        if self.group not in (32, 64, 128):
            bad.append(f"group {self.group} must be 32, 64 or 128")
        elif self.k % self.group:
            bad.append(f"K={self.k} must be a multiple of the group {self.group}")
        if self.acc not in ("float32", "float16"):
            bad.append(f"acc {self.acc!r} must be 'float32' or 'float16'")
        if self.fold and (self.group != 128 or self.acc != "float32"):
            bad.append("fold needs group 128 (one scale per lane and chunk) and fp32 accumulation")
        if self.ntile < 1 or self.warps not in (1, 2, 4, 8, 16) or self.unroll < 1:
            bad.append("ntile >= 1, warps in 1..16 (power of two), unroll >= 1")
        if self.warps * self.max_rows * self.ntile * 8 * 4 > 48 * 1024:
            bad.append(f"the reduction across warps needs warps*M*ntile*32 = {self.warps * self.max_rows * self.ntile * 32} "
                       "bytes of shared memory (48 KiB at most): fewer warps or tiles")
        if self.min_ctas < 0 or self.min_ctas * self.warps > 64:
            bad.append(f"min_ctas={self.min_ctas}: 0 (no bound) or CTAs of {self.warps} warps that fit 64 per SM")
        if self.pdl not in ("", "early", "late"):
            bad.append(f"pdl {self.pdl!r} must be '' (off), 'early' or 'late'")
        if self.dtype not in ("float16", "bfloat16") or (self.dtype == "bfloat16" and self.acc != "float32"):
            bad.append(f"dtype {self.dtype!r}: 'float16', or 'bfloat16' with fp32 accumulation")
        if not 1 <= self.ksplit <= -(-self.k // KCHUNK):
            bad.append(f"ksplit {self.ksplit} must be 1..{-(-self.k // KCHUNK)} (the K chunks of 128)")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    @property
    def max_rows(self) -> int:
        """The most rows a call may have: M, or ``rows`` for a kernel of any M."""
        return self.m or self.rows

    @property
    def tiles(self) -> int:
        return -(-self.n // 8)

    @property
    def chunks(self) -> int:
        return -(-self.k // KCHUNK)

    @property
    def grid(self) -> int:
        """CTAs along N (each owns ``ntile`` 8-row tiles); ``ksplit`` of them along K."""
        return -(-self.tiles // self.ntile)

    @property
    def groups(self) -> int:
        """Scale groups per row, K padded to whole chunks."""
        return self.chunks * KCHUNK // self.group

    def key(self) -> dict:
        d = asdict(self)
        if not self.min_ctas:                        # the key of the kernels built before the bound existed
            del d["min_ctas"]
        if not self.pdl:
            del d["pdl"]
        if self.dtype == "float16":
            del d["dtype"]
        if not self.rows:
            del d["rows"]
        return d


def argument_names(spec: W4A16Spec) -> list[str]:
    return ["X", "Wq", "S", *([] if spec.sym else ["Z"]), *(["B"] if spec.bias else []),
            *(["P", "C"] if spec.ksplit > 1 else []), "Y"]


def split_buffers(spec: W4A16Spec, device) -> dict[str, torch.Tensor]:
    """The workspace of a ``ksplit > 1`` kernel: fp32 partials ``P`` and the zeroed arrival counters ``C``
    (the kernel leaves them zero again); empty for ``ksplit == 1``."""
    if spec.ksplit == 1:
        return {}
    return {"P": torch.empty(spec.ksplit, spec.max_rows, spec.grid * spec.ntile * 8, dtype=torch.float32, device=device),
            "C": torch.zeros(spec.grid, dtype=torch.int32, device=device)}


def quantize(w: torch.Tensor, group: int, sym: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest per-group scales (fp16, ``(N, K/group)``) and zero points (uint8, or None if sym)."""
    g = w.float().reshape(w.shape[0], -1, group)
    if sym:
        scale = (g.abs().amax(-1) / 7.5).clamp_min(1e-6)          # codes 0..15 around 8
        return scale.half(), None
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15).to(torch.uint8)
    return scale, zero


def codes_of(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """int4 codes (uint8 0..15, ``(N, K)``) of ``w`` for the given scales and zero points."""
    z = 8.0 if zero is None else zero.float().repeat_interleave(group, 1)
    q = torch.round(w.float() / scale.float().repeat_interleave(group, 1)) + z
    return q.clamp(0, 15).to(torch.uint8)


def pack_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: W4A16Spec):
    """``(Wq, S, Z)`` in the kernel's layout from codes ``q`` (N, K) uint8; ``Z`` is None if sym."""
    n, k, g = spec.n, spec.k, spec.group
    if tuple(q.shape) != (n, k) or tuple(scale.shape) != (n, k // g):
        raise ValueError(f"codes {tuple(q.shape)} / scales {tuple(scale.shape)} do not match {n}x{k}, group {g}")
    np_, kp = spec.tiles * 8, spec.chunks * KCHUNK
    qp = torch.zeros(np_, kp, dtype=torch.uint8, device=q.device)
    qp[:n, :k] = q.to(torch.uint8)
    qp = qp.reshape(spec.tiles, 8, spec.chunks, 4, 4, 8).permute(0, 2, 1, 3, 4, 5)   # tile, chunk, g, t, word, e
    # byte b of a (little-endian) word holds nibble positions 2b (low) and 2b + 1 (high)
    low, high = ([ORDER.index(2 * b + h) for b in range(4)] for h in (0, 1))
    wq = (qp[..., low] | (qp[..., high] << 4)).contiguous().view(torch.int32).reshape(spec.tiles, spec.chunks, 32, 4)

    def per_group(t, dtype):
        out = torch.zeros(np_, spec.groups, dtype=dtype, device=q.device)
        out[:n, : k // g] = t.to(dtype)
        return out.reshape(spec.tiles, 8, spec.groups).permute(0, 2, 1).contiguous()

    act = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16
    return wq, per_group(scale, act), None if zero is None else per_group(zero, torch.uint8)


def flat_parts(spec: W4A16Spec) -> tuple[int, int, int]:
    """Bytes of the words, scales and zero points (0 when symmetric) in :func:`pack_flat`'s buffer."""
    return spec.tiles * spec.chunks * 512, spec.tiles * spec.groups * 16, 0 if spec.sym else spec.tiles * spec.groups * 8


def pack_flat(wq: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    """``(Wq, S, Z)`` of :func:`pack_codes` as one uint8 buffer (words, scales, zero points): the one pack a 4-bit
    linear holds, read by its GEMVs (:func:`flat_views`) and by the tile kernel of ``BsrSpec(gemv_group=...)``."""
    parts = [wq.contiguous().view(torch.uint8).reshape(-1), s.contiguous().view(torch.uint8).reshape(-1)]
    return torch.cat(parts + ([] if z is None else [z.contiguous().reshape(-1)]))


def flat_views(flat: torch.Tensor, spec: W4A16Spec):
    """``(Wq, S, Z)`` as views of :func:`pack_flat`'s buffer (``Z`` None when symmetric); a buffer of another size
    is refused."""
    nw, ns, nz = flat_parts(spec)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != nw + ns + nz:
        raise ValueError(f"{spec.name}: the packed 4-bit weight must be {nw + ns + nz} bytes (uint8), not "
                         f"{tuple(flat.shape)} {flat.dtype}")
    act = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16
    wq = flat[:nw].view(torch.int32).reshape(spec.tiles, spec.chunks, 32, 4)
    s = flat[nw:nw + ns].view(act).reshape(spec.tiles, spec.groups, 8)
    return wq, s, None if spec.sym else flat[nw + ns:].reshape(spec.tiles, spec.groups, 8)


def pack_weight(w_fp: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: W4A16Spec):
    """Quantise ``w_fp`` (N, K) with ``scale``/``zero`` (None: symmetric) and pack: ``(Wq, S, Z)``."""
    return pack_codes(codes_of(w_fp, scale, zero, spec.group), scale, zero, spec)


def unpack(wq: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, spec: W4A16Spec):
    """Inverse of :func:`pack_codes`: codes (N, K) uint8, scales (N, K/group) fp16, zeros (uint8 or None)."""
    words = wq.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(words >> (4 * pos)) & 0xF for pos in ORDER], -1)         # tile, chunk, lane, word, e
    q = q.reshape(spec.tiles, spec.chunks, 8, 4, 4, 8).permute(0, 2, 1, 3, 4, 5)
    q = q.reshape(spec.tiles * 8, spec.chunks * KCHUNK)[: spec.n, : spec.k].to(torch.uint8)

    def per_group(t):
        return t.permute(0, 2, 1).reshape(spec.tiles * 8, spec.groups)[: spec.n, : spec.k // spec.group]

    return q, per_group(s), None if z is None else per_group(z)


def dequantize(wq, s, z, spec: W4A16Spec) -> torch.Tensor:
    """The (N, K) fp32 weight the kernel multiplies by: ``(q - zero) · scale``."""
    q, scale, zero = unpack(wq, s, z, spec)
    zf = 8.0 if zero is None else zero.float().repeat_interleave(spec.group, 1)
    return (q.float() - zf) * scale.float().repeat_interleave(spec.group, 1)


def reference(x: torch.Tensor, wq, s, z, bias, spec: W4A16Spec) -> torch.Tensor:
    """What the kernel computes, dequantised and multiplied in fp32 (fp32 result)."""
    y = x.float() @ dequantize(wq, s, z, spec).t()
    return y if bias is None else y + bias.float()


def gemv_group(group: int, k: int) -> int:
    """The W4A16 GEMV's scale group for scales of ``group`` columns (32, 64 or 128 dividing K), 0 if none fits."""
    g = 128 if group >= 128 else group
    return g if g in (32, 64, 128) and k % g == 0 and (group >= k or group % g == 0) else 0


def w4_codes(params, weight: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of ``weight`` under ``params`` as the kernels store them: uint8 0..15 (symmetric: +8)."""
    codes = params.codes(weight)
    return (codes + 8 if params.zero is None else codes).to(torch.uint8)
