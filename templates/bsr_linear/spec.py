"""Block-sparse (and dense) tensor-core linear ``Y = act(X · Wᵀ + b)`` for CUDA: the spec, references (TVM-free).

``X`` is ``(M, K)`` fp16, ``W`` is ``(N, K)`` (a linear layer's weight) kept in blocks of
``bn × bk``; ``Y`` is ``(M, N)`` fp16. One CTA computes a ``tm × bn`` tile of ``Y``: a block
row of ``W`` against ``tm`` rows of ``X``, looping only over that row's kept blocks. The
kept blocks are packed contiguously (``Wp``, ``(nnz, bn, bk)``) and visited through a
table of (row, first packed block, count) per CTA row slot plus the blocks' K indices;
slots are ordered by decreasing work so the heaviest rows start first (``packing.py``).

The table is either baked into the kernel as ``__constant__`` data (``table="const"``:
dismantled at the tile level, one kernel per sparsity pattern) or passed as an int32
argument (``table="arg"``: one kernel per shape, shared by every layer of that shape).
Dense is the same kernel with every block kept (``bn`` = the CTA's N extent).

``gate=True`` is a gated linear unit (SwiGLU, GeGLU): ``W`` is ``(2N, K)``, the gate's rows then the up's, and
``Y = act(X · Gᵀ + bg) · (X · Uᵀ + bu)`` is ``(M, N)``. A CTA's slot holds both block rows' kept blocks, the
gate's first (a fourth table entry counts them), each into its own accumulators; the epilogue multiplies them, so
the ``(M, 2N)`` product is never written.

``dtype="int8"`` is the W8A8 kernel: ``X`` int8 (per-row scales ``XS``), ``W`` int8 (per-channel
scales ``WS``), int32 accumulation and ``y = acc · XS[m] · WS[n]`` (+ bias, activation) in the epilogue. Its data
movement is the fp16 kernel's, byte for byte: the int8 operands are handed over as fp16 views of half the width
(``x.view(torch.float16)``), and the m16n8k32 s8 fragments hold the same bytes per thread as the m16n8k16 f16 ones.

``out="int8"`` requantises the output: ``Y`` holds int8 codes ``clamp(round(y · RN(1/s)), ±127)`` of one static
scale ``s`` (argument ``OS = [s, 1/s]``, e.g. fitted by calibration), computed from the fp32 epilogue
value — what a W8A8 linear behind this one reads, without a quantisation pass over an fp16 ``Y``.

``dtype="bfloat16"`` is the fp16 kernel for bf16 ``X``, weights, bias and ``Y`` (mma.sync kernels): the same data
movement of 16-bit lanes, the bf16 MMA, bf16 bias and output rounding (to nearest even) in the epilogue. A W8A8
kernel of a bf16 model writes bf16 ``Y`` from a bf16 bias (``out="bfloat16"``); a W4A16 one also reads bf16 ``X``
and holds bf16 scales (bf16x2 dequantisation, the bf16 MMA).

``dtype="w4a16"`` keeps ``X`` fp16 and stores each kept weight block as an int4 record with its
scales (and zero points, ``zero=True``; ``int4_records.py``), copied to shared memory as
is; each warp turns its words into ``mma.sync`` B fragments in registers (``lop3`` dequantisation). With
``gemv_group`` (32, 64 or 128: the scale group; dense, ``bk=128``) it reads the W4A16 GEMVs' packed weight instead
(``w4a16_gemv.spec.pack_flat``: their words, scales and zero points in one buffer), so one pack serves the GEMVs of
few rows and this tile: the MMA's K order is the GEMV's (lane ``t`` takes K ``32t + 4s .. +4`` of a 128-K chunk in
k16 step ``s``), applied alike to ``X``, whose fragments are 16-byte shared loads instead of ``ldmatrix``.

``pdl="late"`` or ``"tail"`` (the one-tile fp16 or int8 ``mma.sync`` kernel) builds it for programmatic dependent
launch (sm_90; the runtime launches it with the attribute, ``launch.json`` says ``"pdl"``): the table, the column
constants and the prologue's weight blocks load before ``griddepcontrol.wait``, ``X``, the row scales and every write
after it; the next kernel may launch once every CTA has passed its wait ("late") or finished its main loop ("tail") —
so a chain of these overlaps one kernel's tail with the next one's start (as the W4A16 GEMV).

The kernels (``kernel.bsr_linear`` picks one by the spec): ``mma.py`` (``mma.sync``, one tile per CTA),
``stream.py`` (``groups > 0``: a CTA runs a group of block rows), ``wgmma.py`` (``mma="wgmma"``, Hopper) and
``warp_specialized.py`` (``producer=True``: a producer warpgroup, persistent and ping-pong grids).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ..epilogue_ref import ACTIVATIONS, OUTPUTS, activate, gated, to_output

HOPPER_SHARED_BYTES = 227 * 1024                       # the most dynamic shared memory one sm_90 CTA may have
SETMAXNREG = (40, 232)    # ping-pong with > 96 accumulators: registers per producer / consumer thread (setmaxnreg)
KPACK = 32                       # K per word column and per stored scale


@dataclass(frozen=True)
class BsrSpec:
    """Shape, block, tiling and epilogue of one kernel; ``pattern`` only for ``table="const"``."""
    m: int                                            # 0: any number of rows (M a kernel argument)
    n: int
    k: int
    bn: int = 32
    bk: int = 32
    tm: int = 128
    warps_m: int = 4
    warps_n: int = 1
    stages: int = 4
    bias: bool = True
    act: str = "none"
    table: str = "arg"
    dtype: str = "float16"                            # operands: "float16", "bfloat16", "int8" (W8A8) or "w4a16"
    mma: str = "sync"                                 # "sync" (mma.sync, sm_80+) or "wgmma" (sm_90a)
    zero: bool = False                                # w4a16: a uint8 zero point per scale (else code 8)
    groups: int = 0                                   # > 0: streaming grid, CTA (m tile, group) runs its rows in turn
    out: str = "float16"                              # Y: 16-bit (bf16 for dtype "bfloat16"), "bfloat16" (W8A8 in
                                                      # a bf16 model: bf16 Y and bias), or "int8" codes
    producer: bool = False                            # wgmma: a producer warpgroup loads, mbarrier rings
    ctas: int = 0                                     # producer: > 0 = a persistent grid of that many CTAs
    pingpong: bool = False                            # persistent producer: two consumer warpgroups, a tile each
    pdl: str = ""                                     # programmatic dependent launch (sm_90), "late" or "tail"
    gate: bool = False                                # a gated linear unit: Y = act(X·Gᵀ + bg) · (X·Uᵀ + bu)
    gemv_group: int = 0                               # w4a16: > 0 reads the W4A16 GEMVs' pack (that scale group)
    pattern: tuple = field(default=(), repr=False)   # kept (row, kblock) pairs, for table="const"
    name: str = "bsr_linear"

    def __post_init__(self):
        bad = []
        if self.m < 0 or min(self.n, self.k) <= 0:
            bad.append("N and K must be positive, M positive or 0 (any number of rows)")
        if self.k % 8:
            bad.append(f"K={self.k} must be a multiple of 8 (16-byte rows)")
        if self.bk % 16 or self.bk > 128 or self.bn % 16:
            bad.append(f"block {self.bn}x{self.bk}: bn must be a multiple of 16, bk of 16 up to 128")
        if self.mma == "sync" and (self.tm % (16 * self.warps_m) or self.bn % (16 * self.warps_n)):
            bad.append(f"tile {self.tm}x{self.bn} does not split into {self.warps_m}x{self.warps_n} warps "
                       "of 16-multiples")
        if self.act not in ACTIVATIONS:
            bad.append(f"activation {self.act!r} not in {ACTIVATIONS}")
        if self.table not in ("arg", "const"):
            bad.append(f"table {self.table!r} must be 'arg' or 'const'")
        if self.table == "const" and self.pattern_nnz() > 12000:
            bad.append("too many blocks for a constant table (64 KiB); use table='arg'")
        if self.stages < 2:
            bad.append("stages must be >= 2")
        if self.dtype not in ("float16", "bfloat16", "int8", "w4a16"):
            bad.append(f"dtype {self.dtype!r} must be 'float16', 'bfloat16', 'int8' or 'w4a16'")
        elif self.dtype == "bfloat16" and (self.mma != "sync" or self.out != "float16" or self.pdl):
            bad.append("bfloat16: the mma.sync kernels (one tile or streaming), 16-bit out, no pdl")
        if self.out == "bfloat16" and self.dtype not in ("int8", "w4a16"):
            bad.append("out='bfloat16' is for the W8A8 and W4A16 kernels of a bf16 model (16-bit kernels follow "
                       "their dtype)")
        elif self.dtype == "int8" and (self.k % 16 or self.bk % 32):
            bad.append(f"int8: K={self.k} must be a multiple of 16 and bk={self.bk} of 32")
        elif self.dtype == "w4a16" and (self.bk % 32 or self.bn % 16 or self.mma != "sync"):
            bad.append(f"w4a16: bk={self.bk} must be a multiple of 32 (a word of 8 nibbles per lane) and mma 'sync'")
        if self.out not in OUTPUTS:
            bad.append(f"out {self.out!r} must be one of {OUTPUTS}")
        if self.zero and self.dtype != "w4a16":
            bad.append("zero points are for dtype='w4a16'")
        if self.groups < 0 or (self.groups and self.mma != "sync"):
            bad.append(f"groups={self.groups} must be >= 0, and > 0 only with mma 'sync'")
        if (self.producer or self.ctas) and (self.mma != "wgmma" or not self.producer or self.ctas < 0):
            bad.append(f"producer={self.producer}, ctas={self.ctas}: a producer warpgroup is for mma 'wgmma', "
                       "and a persistent grid (ctas > 0) for a producer kernel")
        if self.producer and self.m == 0 and not self.ctas:
            bad.append("a producer kernel of any number of rows (m=0) needs a persistent grid (ctas > 0)")
        if self.pingpong and (not self.ctas or self.warps_m > 2 or self.warps_n != 1):
            bad.append(f"pingpong: for a persistent producer kernel (ctas > 0), warps_m 1 or 2 (m64 rows per "
                       f"consumer warpgroup) and warps_n 1, not ctas={self.ctas}, {self.warps_m}x{self.warps_n}")
        if self.pdl not in ("", "late", "tail") or (self.pdl and (self.mma != "sync" or self.groups
                                                                   or self.dtype == "w4a16")):
            bad.append(f"pdl {self.pdl!r}: '' (off), 'late' or 'tail', for the fp16 or int8 mma.sync kernel of one "
                       "tile per CTA (groups=0)")
        if self.gate and (self.dtype not in ("float16", "bfloat16") or self.mma != "sync" or self.groups
                          or self.out != "float16" or self.table != "arg" or self.pdl):
            bad.append("gate: the 16-bit mma.sync kernel of one tile per CTA (groups=0), table 'arg', 16-bit out, "
                       "no pdl")
        if self.gemv_group and (self.gemv_group not in (32, 64, 128) or self.dtype != "w4a16" or self.bk != 128
                                or self.k % self.gemv_group or self.table != "arg" or self.groups or self.gate
                                or self.out == "int8"):
            bad.append(f"gemv_group={self.gemv_group}: the W4A16 GEMVs' pack (scale groups of 32, 64 or 128 dividing K) "
                       "for a w4a16 tile of bk=128, table 'arg', one tile per CTA, not gated, 16-bit out")
        if self.mma not in ("sync", "wgmma"):
            bad.append(f"mma {self.mma!r} must be 'sync' or 'wgmma'")
        elif self.mma == "wgmma":
            bad += self._wgmma_problems()
        if not bad and self.mma == "wgmma" and self.shared_bytes > HOPPER_SHARED_BYTES:
            bad.append(f"wgmma: {self.shared_bytes} bytes of shared memory (stages, output tile, constants) exceed "
                       f"the {HOPPER_SHARED_BYTES} a Hopper CTA can have: fewer stages or a smaller tile")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    def _wgmma_problems(self) -> list[str]:
        bad = []
        wtn = self.bn // self.warps_n
        if self.tm != 64 * self.warps_m:
            bad.append(f"wgmma: tm={self.tm} must be 64 x warps_m (warps_m, warps_n count warpgroups)")
        if self.bn % self.warps_n or wtn % 16 or wtn > (224 if self.dtype == "int8" else 256):
            bad.append(f"wgmma: bn/warps_n={self.bn}/{self.warps_n} must be a multiple of 16 up to "
                       f"{224 if self.dtype == 'int8' else 256}")
        if self.bk // self.elems_per_half not in (16, 32, 64):
            bad.append(f"wgmma: bk={self.bk} must span 32, 64 or 128 bytes (one swizzle atom)")
        if self.stages < 3:
            bad.append("wgmma: stages must be >= 3 (one stage drains while two load)")
        nacc = self.consumer_accumulators
        budget = SETMAXNREG[1] if self.moves_registers else min(255, 65536 // self.threads)
        if nacc + (32 if self.producer else 40) > budget:   # consumers do no loads
            bad.append(f"wgmma: {nacc} accumulator registers per thread do not fit beside the rest with "
                       f"{self.threads} threads (65536 registers per SM): fewer warpgroups or a narrower bn")
        return bad

    @property
    def act16(self) -> str:
        """The 16-bit activation type of X, the bias and a 16-bit Y: bf16 for ``dtype="bfloat16"``, else fp16."""
        return "bfloat16" if "bfloat16" in (self.dtype, self.out) else "float16"

    @property
    def y_lanes(self) -> str:
        """The TIR type of ``Y``'s elements: int8 codes, or 16-bit lanes typed fp16 (bf16 bits moved as they are)."""
        return "int8" if self.out == "int8" else "float16"

    @property
    def archs(self) -> tuple[str, ...]:
        """The GPU architectures nvcc builds this kernel for."""
        return ("sm_90a",) if self.mma == "wgmma" else ("sm_80", "sm_90")

    @property
    def row_blocks(self) -> int:
        return -(-self.n // self.bn)

    @property
    def weight_rows(self) -> int:
        """Rows of the weight the kernel applies: ``n``, or ``2n`` for a gated kernel (gate rows, then up rows)."""
        return 2 * self.n if self.gate else self.n

    @property
    def weight_row_blocks(self) -> int:
        """Block rows of the packed weight: the output's, twice over for a gated kernel (``packing.gate_padded``)."""
        return 2 * self.row_blocks if self.gate else self.row_blocks

    @property
    def slot_ints(self) -> int:
        """int32 entries per table slot: (row, first block, count), and for a gated kernel the gate's count."""
        return 4 if self.gate else 3

    @property
    def k_blocks(self) -> int:
        return -(-self.k // self.bk)

    @property
    def threads(self) -> int:
        if self.pingpong:                            # a producer and two consumer warpgroups
            return 384
        return (128 if self.mma == "wgmma" else 32) * self.warps_m * self.warps_n + 128 * self.producer

    @property
    def elems_per_half(self) -> int:
        """Operand elements per 16-bit lane of the data movement (2 for int8)."""
        return 2 if self.dtype == "int8" else 1

    @property
    def w_lanes(self) -> int:
        """16-bit lanes of one packed weight block (a W4A16 block is a record: words, scales, zeros)."""
        if self.dtype == "w4a16":
            return record_lanes(self.bn, self.bk, self.zero)
        return self.bn * self.bk // self.elems_per_half

    @property
    def out_ld(self) -> int:
        """Row pitch of the staged output tile, in its elements (fp16 lanes or int8 bytes): 16 bytes of
        padding, so the fragments' writes do not conflict."""
        return self.bn + (16 if self.out == "int8" else 8)

    @property
    def out_lanes(self) -> int:
        """16-bit lanes of shared memory the staged output tile takes."""
        return self.tm * self.out_ld // (2 if self.out == "int8" else 1)

    @property
    def shared_bytes(self) -> int:
        if self.producer:                            # + the mbarrier rings (full, empty: 8 bytes each)
            return self.barrier_offset + 16 * self.stages + 16 * self.pingpong   # + two turn barriers
        if self.groups:                              # streaming: two buffers of column constants
            return self.const_offset + 2 * self.bn * 8
        return self.const_offset + self.bn * 8

    @property
    def _stage_lanes(self) -> int:
        return self.tm * self.bk // self.elems_per_half + self.w_lanes

    @property
    def const_offset(self) -> int:
        """Byte offset in shared memory of the epilogue's fp32 column constants (``FragmentEpilogue``; two buffers
        in a producer or a streaming kernel): after the stages and the staged output tile, which overlays the stages
        unless the grid is persistent or streaming."""
        stages = self.stages * self._stage_lanes
        body = stages + self.roles * self.out_lanes if self.ctas or self.groups else max(stages, self.out_lanes)
        return -(-body * 2 // 16) * 16

    @property
    def barrier_offset(self) -> int:
        """Byte offset of a producer kernel's mbarrier rings: after its two buffers of column constants (per
        consumer role)."""
        return self.const_offset + 2 * self.roles * self.bn * 8

    @property
    def consumer_accumulators(self) -> int:
        """wgmma accumulator registers per consumer thread (a ping-pong warpgroup holds all ``warps_m`` halves)."""
        return self.bn // self.warps_n // 2 * (self.warps_m if self.pingpong else 1)

    @property
    def moves_registers(self) -> bool:
        """Ping-pong roles with more than 96 accumulators take registers from the producer (``SETMAXNREG``)."""
        return self.pingpong and self.consumer_accumulators > 96

    @property
    def roles(self) -> int:
        """Consumers that own a tile each: two warpgroups in ping-pong, else all consumer warps together."""
        return 2 if self.pingpong else 1

    @property
    def table_tail(self) -> int:
        """int32 entries between the slots and the K indices: (first slot, first block) per group + an end mark."""
        return 2 * (self.groups + 1) if self.groups else 0

    @property
    def table_head(self) -> int:
        """int32 entries before the K indices: ``slot_ints`` per slot, then the tail."""
        return self.slot_ints * self.row_blocks + self.table_tail

    def rows(self):
        """M in the kernel's TIR: the spec's rows, or for ``m=0`` the scalar argument ``M`` (call once per build:
        every part of one kernel shares the variable)."""
        from tvm import tirx
        return tirx.Var("M", "int32") if self.m == 0 else self.m

    def pattern_nnz(self) -> int:
        return len(self.pattern)

    def pattern_mask(self) -> torch.Tensor:
        """The baked ``pattern`` as a (row_blocks, k_blocks) bool mask."""
        mask = torch.zeros(self.row_blocks, self.k_blocks, dtype=torch.bool)
        for r, c in self.pattern:
            mask[r, c] = True
        return mask

    def key(self) -> dict:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "pattern"}
        if self.dtype != "w4a16":
            del d["zero"]
        if not self.groups:
            del d["groups"]
        if self.out == "float16":
            del d["out"]
        if not self.producer:
            del d["producer"], d["ctas"]
        if not self.pingpong:
            del d["pingpong"]
        if not self.pdl:
            del d["pdl"]
        if not self.gate:
            del d["gate"]
        if not self.gemv_group:
            del d["gemv_group"]
        if self.table == "const":
            d["pattern"] = hashlib.sha256(repr(sorted(self.pattern)).encode()).hexdigest()
        return d


def argument_names(spec: BsrSpec) -> list[str]:
    scales = ["XS", "WS"] if spec.dtype == "int8" else []
    return ["X", "Wp", *scales, *(["B"] if spec.bias else []), *(["OS"] if spec.out == "int8" else []),
            *(["Tab"] if spec.table == "arg" else []), "Y"]


def record_lanes(bn: int, bk: int, zero: bool) -> int:
    """16-bit lanes of one packed block: words, scales, zero points."""
    kw = bk // KPACK
    return bn * bk // 4 + kw * bn + (kw * bn // 2 if zero else 0)


def gate_padded(w: torch.Tensor, n: int, bn: int) -> torch.Tensor:
    """A gated kernel's ``(2n, K)`` weight (gate rows, then up rows) as its packed layout's rows: the gate's block
    rows padded to ``bn``, then the up's (``2 · ceil(n / bn) · bn`` rows), so no block row holds both."""
    rows = -(-n // bn) * bn
    out = w.new_zeros(2 * rows, w.shape[1])
    out[:n], out[rows:rows + n] = w[:n], w[n:2 * n]
    return out


def gate_unpadded(p: torch.Tensor, n: int, bn: int) -> torch.Tensor:
    """Inverse of :func:`gate_padded` (rows of a weight, or columns of ``p.t()``'s product)."""
    rows = p.shape[0] // 2
    return torch.cat([p[:n], p[rows:rows + n]])


def reference(x: torch.Tensor, w: torch.Tensor, block_mask: torch.Tensor | None, bias: torch.Tensor | None,
              act: str, bn: int, bk: int, out_scale: float | None = None, gate: bool = False) -> torch.Tensor:
    """What the kernel computes, in fp32 from the 16-bit operands, rounded to ``x``'s 16-bit type at the end (bf16
    for bf16 ``x``, else fp16; or, with ``out_scale``, requantised to int8 codes: ``out="int8"``). ``gate``: ``w``
    and ``bias`` hold the gate's rows then the up's (``block_mask`` over :func:`gate_padded`'s rows), the output is
    ``act(gate) · up``."""
    w = w.float()
    n = w.shape[0] // 2 if gate else w.shape[0]
    if block_mask is not None:
        p = gate_padded(w, n, bn) if gate else w
        keep = block_mask.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: p.shape[0], : p.shape[1]]
        p = p * keep.to(w.device)
        w = gate_unpadded(p, n, bn) if gate else p
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    y = gated(y, act) if gate else activate(y, act)
    if x.dtype == torch.bfloat16 and out_scale is None:
        return y.bfloat16()
    return to_output(y, out_scale)


def reference_int8(xq, xs, wq, ws, block_mask, bias, act: str, bn: int, bk: int,
                   out_scale: float | None = None, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """What the W8A8 kernel computes: exact int32 dot products, scaled in fp32, ``dtype`` out (fp16, or bf16 for
    ``out="bfloat16"``; or, with ``out_scale``, int8 codes)."""
    w = wq.double()
    if block_mask is not None:
        keep = block_mask.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
        w = w * keep.to(w.device)
    y = (xq.double() @ w.t()).float() * xs.float()[:, None] * ws.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return to_output(activate(y, act), out_scale, dtype)
