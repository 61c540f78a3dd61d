"""The few-row block-sparse 16-bit GEMV of ``bsr_linear``: the spec (TVM-free; ``spec.reference`` is its reference).

``Y = act(X · Wᵀ + b)`` for ``X`` of 1 to ``rows`` rows (decode), reading the packed weights and table of the
one-tile and streaming kernels (``packing.pack_weight``, fp16 blocks of ``bn × bk``): one packed weight per linear
serves both (fp16, or bf16 for ``dtype="bfloat16"``), and the runtime picks this kernel for ``M <= rows``. A CTA owns ``unit_rows`` rows of one block row;
its warps take the row's kept blocks round robin, each lane streams 16-byte pieces of a block (``bk / 8`` lanes per
block row, coalesced: a warp's load is 512 contiguous bytes) and keeps fp32 sums per (row, token); the lanes of a
row add by shuffles, the warps through shared memory, and the epilogue adds bias and activation. ``M`` is a kernel
argument: one build serves every row count up to ``rows``. The table's layout follows the tile kernel it shares
(``groups``: the streaming kernel's). ``pdl``: launched as a programmatic dependent (sm_90), the first blocks'
weights load while the previous kernel in the stream finishes; ``X`` (its output) and every write wait for it.

The parallelism knobs (their defaults: the kernel as first measured): ``loads`` 16-byte loads per lane per block
(0: as many as the block has rows for, up to ``LOADS``) set ``unit_rows``, the rows a CTA owns: fewer, more CTAs
and fewer registers. ``inflight`` blocks a warp loads (weights and K indices) before it multiplies any: 1, 2, or 4,
where the round's ``X`` pieces load too before the first product.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..epilogue_ref import ACTIVATIONS

LOADS = 4                       # 16-byte loads per lane per block (rows a lane sums)


@dataclass(frozen=True)
class BsrGemvSpec:
    n: int
    k: int
    bn: int = 32
    bk: int = 32
    rows: int = 16              # the most rows (tokens) a call may have
    warps: int = 4
    bias: bool = True
    act: str = "none"
    groups: int = 0             # the table's layout: the streaming kernel's (groups > 0) or the one-tile kernel's
    pdl: bool = False           # programmatic dependent launch (sm_90): weights load before the previous kernel ends
    dtype: str = "float16"      # the 16-bit activations and weights: "float16" or "bfloat16"
    gate: bool = False          # a gated linear unit over the tile kernel's gated table (``BsrSpec.gate``)
    name: str = "bsr_gemv"
    loads: int = 0              # 16-byte loads per lane per block (``lane_loads``); 0: the most the block has rows for
    inflight: int = 2           # blocks a warp keeps in flight per round: 1, 2 or 4

    def __post_init__(self):
        bad = []
        if self.n <= 0 or self.k <= 0 or self.k % 8:
            bad.append(f"N, K must be positive and K={self.k} a multiple of 8 (16-byte rows)")
        block = self.bk in (16, 32, 64, 128) and self.bn > 0 and self.bn % 16 == 0
        if not block:
            bad.append(f"block {self.bn}x{self.bk}: bk 16, 32, 64 or 128, bn a multiple of 16")
        if self.loads not in (0, 1, 2, 4):
            bad.append(f"loads={self.loads} must be 1, 2 or 4 (0: the default rule)")
        elif block and self.bn % self.unit_rows:
            bad.append(f"bn={self.bn} is not a multiple of the {self.unit_rows} rows a CTA owns")
        if self.inflight not in (1, 2, 4):
            bad.append(f"inflight={self.inflight} must be 1, 2 or 4")
        if not 1 <= self.rows <= 16:
            bad.append(f"rows={self.rows} must be 1..16 (a GEMV for decode; more rows want the tile kernels)")
        if self.warps not in (1, 2, 4, 8, 16):
            bad.append("warps must be 1, 2, 4, 8 or 16")
        if self.act not in ACTIVATIONS:
            bad.append(f"activation {self.act!r} not in {ACTIVATIONS}")
        if self.groups < 0:
            bad.append("groups must be >= 0")
        if self.gate and self.groups:
            bad.append("gate: the one-tile kernel's table (groups=0)")
        if self.dtype not in ("float16", "bfloat16"):
            bad.append(f"dtype {self.dtype!r} must be 'float16' or 'bfloat16'")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    @property
    def lanes_per_row(self) -> int:
        return self.bk // 8

    @property
    def lane_loads(self) -> int:
        """16-byte loads per lane per block: rows a lane sums, ``32 / lanes_per_row`` rows apart (``loads``, or 0: as
        many as the block has rows for, up to ``LOADS``)."""
        return self.loads or max(1, min(LOADS, self.bn * self.lanes_per_row // 32))

    @property
    def unit_rows(self) -> int:
        """Rows of a block row one CTA owns."""
        return self.lane_loads * 32 // self.lanes_per_row

    @property
    def row_blocks(self) -> int:
        return -(-self.n // self.bn)

    @property
    def ctas(self) -> int:
        return self.row_blocks * (self.bn // self.unit_rows)

    @property
    def table_head(self) -> int:
        """int32 entries of the shared table before the K indices (``BsrSpec.table_head``)."""
        return self.slot_ints * self.row_blocks + (2 * (self.groups + 1) if self.groups else 0)

    @property
    def slot_ints(self) -> int:
        return 4 if self.gate else 3

    def key(self) -> dict:
        d = asdict(self)
        for field, default in (("gate", False), ("loads", 0), ("inflight", 2)):
            if d[field] == default:      # keys of kernels built before the field existed stay as they were
                del d[field]
        return d
