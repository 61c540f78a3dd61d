"""The decode-attention kernels' spec, input checks and torch reference (TVM-free).

One query token per sequence attends over a static KV cache: ``q`` (B, Hq, D), ``k`` and ``v`` (B, Hkv, S, D) (Hugging
Face's StaticCache layer tensors), ``keep`` (B, S) bool (True where the key may be attended), ``scale`` the softmax
scale. Query head ``h`` reads kv head ``h // G`` (``G = Hq / Hkv``, grouped-query attention)::

    out[b, h] = softmax_j((q[b, h] · k[b, h // G, j]) · scale over the kept j) @ v[b, h // G]

A row with no kept key outputs zeros (SDPA would give NaN). The kernels split the keys into chunks of ``chunk``
(flash-decoding): ``stage="partial"`` computes each chunk's max, sum of exponentials and weighted sum of V into an fp32
workspace, skipping the chunks with no kept key; ``stage="combine"`` merges the chunks and writes ``out``.

``rope``: the step's own work before attention in one pass too (a Hugging Face decoder's rotary embedding and static
cache write): the step's projections arrive stacked, ``qkv`` (B, Hq + 2 Hkv, D) — the query heads, the new key's,
the new value's, as one stacked q/k/v linear writes them (no copy of their slices at any batch) — before the rotary
embedding, which the partial kernel applies (``x · cos + rotate_half(x) · sin``, ``cos``/``sin`` (B, D)); the CTA
whose chunk holds the write position ``position`` (a (1,) int64 counter, Hugging Face's ``cumulative_length``) stores
the rotated key and the value into the cache there, and the combine kernel adds one to the counter once every partial
CTA has read it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from ...errors import SpartaError

HEAD_DIMS = (64, 128, 256)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
STAGES = ("partial", "combine")
SHARED_LIMIT = 48 * 1024          # static shared memory of one CTA


class DecodeAttentionError(SpartaError, ValueError):
    """A decode-attention spec or call that the kernels cannot run; the message says why."""


@dataclass(frozen=True)
class DecodeAttentionSpec:
    hq: int                    # query heads
    hkv: int                   # kv heads (hq a multiple of it)
    d: int                     # head dimension: 64, 128 or 256
    dtype: str = "bfloat16"    # q, k, v and out: "float16" or "bfloat16"
    chunk: int = 64            # keys per split: a multiple of 32, at most 256
    threads: int = 128         # threads per CTA of either stage
    stage: str = "partial"     # "partial": one chunk's softmax partials; "combine": merge them into out
    pdl: bool = True           # programmatic dependent launch (sm_90): each kernel may start as the last one ends
    rope: bool = False         # rotary embedding of q and the new key, and the cache write, in the same kernels
    name: str = "decode_attention"

    def __post_init__(self):
        bad = []
        if min(self.hq, self.hkv) < 1 or self.hq % self.hkv:
            bad.append(f"query heads Hq={self.hq} must be a positive multiple of the kv heads Hkv={self.hkv}")
        if self.d not in HEAD_DIMS:
            bad.append(f"head dimension D={self.d} is not supported (one of {HEAD_DIMS})")
        if self.dtype not in DTYPES:
            bad.append(f"dtype {self.dtype!r} must be one of {tuple(DTYPES)}")
        if self.chunk % 32 or not 32 <= self.chunk <= 256:
            bad.append(f"chunk={self.chunk} keys per split must be a multiple of 32 from 32 to 256")
        if self.threads not in (64, 128, 256, 512):
            bad.append(f"threads={self.threads} must be 64, 128, 256 or 512")
        if self.stage not in STAGES:
            bad.append(f"stage {self.stage!r} must be one of {STAGES}")
        if not bad and self.stage == "partial":
            if self.keys_per_step > 32 or self.chunk % self.keys_per_step:
                bad.append(f"threads={self.threads} cover {self.keys_per_step} keys of D={self.d} a step: at most "
                           f"32, dividing chunk={self.chunk}")
            elif self.steps > 8:
                bad.append(f"{self.steps} keys a thread (chunk={self.chunk} over {self.keys_per_step} a step) is over "
                           "the 8 of K and of V a thread keeps in registers (more threads or a smaller chunk)")
            elif self.steps * self.group > 64:
                bad.append(f"{self.steps} keys a thread times G={self.group} heads is over 64 scores in registers "
                           "(more threads or a smaller chunk)")
            elif self.shared_floats * 4 > SHARED_LIMIT:
                bad.append(f"G={self.group} heads x D={self.d} x {self.threads // 32} warps of fp32 sums is over "
                           f"{SHARED_LIMIT} bytes of shared memory")
        if bad:
            raise DecodeAttentionError(f"decode attention spec {self.name}: " + "; ".join(bad))

    @property
    def q_heads(self) -> int:
        """Heads of the kernels' ``q`` input: Hq, or for ``rope`` the stacked projections' Hq + 2 Hkv."""
        return self.hq + 2 * self.hkv if self.rope else self.hq

    @property
    def group(self) -> int:
        """G: query heads per kv head."""
        return self.hq // self.hkv

    @property
    def lanes_per_key(self) -> int:
        """Lanes holding one key's (or value's) row, 16 bytes each."""
        return self.d // 8

    @property
    def keys_per_step(self) -> int:
        """Keys the CTA loads in one step (one 16-byte load per thread)."""
        return self.threads // self.lanes_per_key

    @property
    def steps(self) -> int:
        """Keys (and values) each thread of the partial stage holds: loads in flight per thread, each of K and V."""
        return self.chunk // self.keys_per_step

    @property
    def shared_floats(self) -> int:
        """fp32 sums of the partial stage's warps: a (G, D) slice and the G sums per warp."""
        return (self.threads // 32) * self.group * (self.d + 1)

    def splits(self, s: int) -> int:
        """Chunks (splits) of a cache of ``s`` keys."""
        return -(-s // self.chunk)

    def pair(self) -> tuple[DecodeAttentionSpec, DecodeAttentionSpec]:
        """The (partial, combine) specs of this one's kernels."""
        return replace(self, stage="partial"), replace(self, stage="combine")

    def key(self) -> dict:
        d = asdict(self)
        if not self.rope:              # the key of the kernels built before the field existed
            del d["rope"]
        return d


def check_inputs(spec: DecodeAttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keep: torch.Tensor) -> tuple[int, int]:
    """Refuse inputs the kernels cannot read (they read contiguous tensors of the spec's heads, D and dtype); (B, S)."""
    dtype, where = DTYPES[spec.dtype], f"decode attention {spec.name}"
    for name, t, rank in (("q", q, 3), ("k", k, 4), ("v", v, 4), ("keep", keep, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise DecodeAttentionError(f"{where}: {name} must be a {rank}-d tensor, got "
                                       f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not t.is_contiguous():
            raise DecodeAttentionError(f"{where}: {name} must be contiguous")
        want = torch.bool if name == "keep" else dtype
        if t.dtype != want:
            raise DecodeAttentionError(f"{where}: {name} must be {want}, got {t.dtype}")
    b, s = k.shape[0], k.shape[2]
    if tuple(q.shape) != (b, spec.q_heads, spec.d):
        what = "qkv must be (B, Hq + 2 Hkv, D)" if spec.rope else "q must be (B, Hq, D)"
        raise DecodeAttentionError(f"{where}: {what} = ({b}, {spec.q_heads}, {spec.d}), got {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (b, spec.hkv, s, spec.d):
            raise DecodeAttentionError(f"{where}: {name} must be (B, Hkv, S, D) = ({b}, {spec.hkv}, {s}, {spec.d}), "
                                       f"got {tuple(t.shape)}")
    if tuple(keep.shape) != (b, s):
        raise DecodeAttentionError(f"{where}: keep must be (B, S) = ({b}, {s}), got {tuple(keep.shape)}")
    if len({t.device for t in (q, k, v, keep)}) != 1:
        raise DecodeAttentionError(f"{where}: q, k, v and keep must be on one device")
    if k.numel() >= 2 ** 31:
        raise DecodeAttentionError(f"{where}: a cache of {k.numel()} elements per tensor is over the kernels' 32-bit "
                                   "indices")
    return b, s


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The attention of ``q`` (B, Hq, D) over the kept keys of ``k``, ``v`` (B, Hkv, S, D) in fp32, in ``q``'s dtype;
    zeros for a row with no kept key."""
    b, hq, d = q.shape
    g = hq // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)                       # (B, Hq, S, D)
    vf = v.float().repeat_interleave(g, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), kf) * scale
    scores = scores.masked_fill(~keep[:, None, :], -math.inf)
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhs,bhsd->bhd", p, vf) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.to(q.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary embedding ``x · cos + rotate_half(x) · sin`` of ``x`` (B, H, D) with ``cos``/``sin``
    (B, D), in fp32 and rounded once to ``x``'s dtype (what the kernel computes)."""
    xf, d = x.float(), x.shape[-1]
    half = torch.cat([-xf[..., d // 2:], xf[..., : d // 2]], -1)
    return (xf * cos.float()[:, None] + half * sin.float()[:, None]).to(x.dtype)


def check_rope_inputs(spec: DecodeAttentionSpec, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k: torch.Tensor, position: torch.Tensor) -> None:
    """Refuse the rotary kernels' extra inputs where they do not fit ``qkv`` (B, Hq + 2 Hkv, D) and the cache ``k``."""
    dtype, where = DTYPES[spec.dtype], f"decode attention {spec.name}"
    b = qkv.shape[0]
    for name, t, shape in (("cos", cos, (b, spec.d)), ("sin", sin, (b, spec.d))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise DecodeAttentionError(f"{where}: {name} must be a contiguous {dtype} tensor of shape {shape}, got {got}")
    if not isinstance(position, torch.Tensor) or position.numel() != 1 or position.dtype != torch.int64:
        raise DecodeAttentionError(f"{where}: position must be one int64 value (the cache's write counter)")
    if len({t.device for t in (qkv, cos, sin, k, position)}) != 1:
        raise DecodeAttentionError(f"{where}: every input must be on one device")


def split_qkv(qkv: torch.Tensor, hkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k_new, v_new)`` of the stacked projections ``qkv`` (B, Hq + 2 Hkv, D)."""
    hq = qkv.shape[1] - 2 * hkv
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


def decode_attention_rope_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, keep: torch.Tensor, position: torch.Tensor, scale: float) -> torch.Tensor:
    """What the ``rope`` kernels do: rotate the query heads and the new key of ``qkv`` (B, Hq + 2 Hkv, D), store the
    rotated key and the new value into ``k``, ``v`` at ``position`` (in place), add one to ``position`` (in place) and
    attend over the kept keys."""
    q, k_new, v_new = split_qkv(qkv, k.shape[1])
    p = int(position.reshape(-1)[0])
    k[:, :, p] = rotate(k_new, cos, sin)
    v[:, :, p] = v_new
    position.add_(1)
    return decode_attention_ref(rotate(q, cos, sin), k, v, keep, scale)


def workspace_shapes(spec: DecodeAttentionSpec, b: int, s: int) -> dict[str, tuple[int, ...]]:
    """The fp32 workspace the partial stage writes and the combine stage reads: ``O`` (B, Hq, splits, D), the weighted
    sums of V; ``ML`` (B, Hq, splits, 2), each chunk's max score (times log2 e) and sum of exponentials (2 ** (score
    - max))."""
    n = spec.splits(s)
    return {"O": (b, spec.hq, n, spec.d), "ML": (b, spec.hq, n, 2)}


__all__ = ["DecodeAttentionSpec", "DecodeAttentionError", "check_inputs", "check_rope_inputs", "decode_attention_ref",
           "decode_attention_rope_ref", "rotate", "split_qkv", "workspace_shapes", "HEAD_DIMS", "DTYPES"]
