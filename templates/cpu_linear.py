"""CPU block-sparse linear ``Y = X · Wᵀ (+ b, activation)`` as a TIR template.

The weight is stored as its kept ``BH × BW`` blocks only, each ``k``-major
(``W[p, kk, r]`` = ``w[bi·BH + r, bj·BW + kk]``). The kernel walks panels of ``PANEL``
rows of ``X`` in parallel; for each output block row and each ``RV``-wide slice of it, a
``MT × RV`` register tile accumulates ``x[m, k] · w[k, r]`` over the row's kept blocks
(broadcast-FMA micro-kernel, vectorised over ``r``), then the epilogue adds the bias,
applies the activation and stores.

How the kept blocks are found is the dismantle level (``spec.dismantle``):

* ``"none"``: the generic BCSR kernel, reading row pointers ``P`` and columns ``C`` at run time;
* ``"full"``: every grid block is emitted under a compile-time condition and TVM's
  simplifier deletes the pruned ones: no index array, no code for pruned blocks;
* ``"tile"``: block rows are specialised (empty rows vanish, loop bounds are constants)
  but a row's blocks are looped over a compile-time column list, bounding code size.

Weight precisions: 32 (fp32), 8 (int8 × int8 activations, int32 accumulation, per-row
activation scale × per-channel weight scale), 4 (int4 codes ``u`` dequantised to fp32 in the
loop as ``u · S + O``: one scale and offset per block row and ``scale_group`` columns, which
holds symmetric (``O = -8 S``) and asymmetric (``O = -zero · S``) quantisation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .epilogue import tir_activation, torch_epilogue

MT, PANEL = 4, 64          # register-tile rows; rows per parallel task


@dataclass(frozen=True)
class BlockLinearSpec:
    m: int
    n: int                                  # multiple of block[0]
    k: int                                  # multiple of block[1]
    block: tuple[int, int]
    rows: tuple[tuple[int, ...], ...]       # kept block columns of each block row
    weight_bits: int = 32
    bias: bool = False
    activation: str | None = None
    accumulate: bool = False
    dismantle: str = "full"
    name: str = "block_linear"
    scale_group: int = 0                    # int4: columns per scale inside a block (0: the block width)

    def __post_init__(self):
        bh, bw = self.block
        if self.n % bh or self.k % bw or len(self.rows) != self.n // bh:
            raise ValueError(f"spec {self.name}: N={self.n}, K={self.k} must be multiples of the block {self.block} "
                             f"and rows must list {self.n // bh} block rows")
        if self.weight_bits not in (32, 8, 4) or (self.weight_bits == 4 and bh % 2):
            raise ValueError(f"spec {self.name}: unsupported weight bits {self.weight_bits} for block {self.block}")
        if self.weight_bits == 4 and bw % self.group_columns:
            raise ValueError(f"spec {self.name}: scale_group {self.scale_group} must divide the block width {bw}")
        if self.dismantle not in ("none", "full", "tile"):
            raise ValueError(f"spec {self.name}: unknown dismantle level {self.dismantle!r}")

    @property
    def group_columns(self) -> int:
        return self.scale_group or self.block[1]

    @property
    def n_blocks(self) -> int:
        return sum(len(r) for r in self.rows)

    def offsets(self) -> list[int]:
        """Packed index of each block row's first block."""
        out, p = [], 0
        for r in self.rows:
            out.append(p)
            p += len(r)
        return out

    def key(self) -> dict:
        """What the compiled code depends on: a generic (``"none"``) kernel reads the block
        structure at run time, so every weight of one shape shares it."""
        d = asdict(self)
        if self.dismantle == "none":
            d["rows"] = None
        return d

    def generic_name(self) -> str:
        """A name for the shared generic kernel of this shape."""
        bh, bw = self.block
        tail = "".join(["_b" if self.bias else "", f"_{self.activation}" if self.activation else "",
                        "_acc" if self.accumulate else "",
                        f"_g{self.scale_group}" if self.weight_bits == 4 and self.scale_group else ""])
        return f"bsr_m{self.m}_n{self.n}_k{self.k}_{bh}x{bw}_w{self.weight_bits}{tail}"


def vector_width(bh: int) -> int:
    for rv in (16, 8, 4, 2):
        if bh % rv == 0:
            return rv
    return 1


# ---- packing and the torch reference -----------------------------------------------------------

def pack(spec: BlockLinearSpec, weight: torch.Tensor, scale: torch.Tensor | None = None,
         zero: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Kernel arguments holding only the kept blocks of ``weight`` (N, K) (plus scales/indices).

    Quantised widths take fitted element-wise ``scale`` (and, for asymmetric int4, ``zero``: the
    integer code of 0) of shape (N, K), constant over each kernel scale group; without them the
    scales come from each group's absolute maximum (symmetric).
    """
    bh, bw = spec.block
    w = weight.detach().to(torch.float32).reshape(spec.n // bh, bh, spec.k // bw, bw)
    coords = [(i, j) for i, row in enumerate(spec.rows) for j in row]

    def blocks_of(t):                                   # (nb, bw, bh) k-major
        t = t.reshape(spec.n // bh, bh, spec.k // bw, bw)
        return torch.stack([t[i, :, j, :].t() for i, j in coords]) if coords else torch.zeros(1, bw, bh)

    wp = blocks_of(w)
    out = {}
    if spec.weight_bits == 32:
        out["W"] = wp.contiguous()
    elif spec.weight_bits == 8:
        if zero is not None:
            raise ValueError(f"spec {spec.name}: int8 weights are symmetric (the int8 dot product has no zero point)")
        if scale is None:
            ch = weight.detach().to(torch.float32).abs().amax(1).clamp_min(1e-12) / 127.0      # per channel
        else:
            ch = scale[:, 0].to(torch.float32)
            if not torch.equal(scale, ch[:, None].expand_as(scale)):
                raise ValueError(f"spec {spec.name}: int8 weight scales must be per channel")
        rows = torch.cat([torch.arange(i * bh, (i + 1) * bh) for i, _ in coords]) if coords \
            else torch.zeros(bh, dtype=torch.long)
        out["W"] = torch.round(wp / ch[rows].reshape(-1, 1, bh)).clamp(-127, 127).to(torch.int8).contiguous()
        out["WS"] = ch.contiguous()
    else:
        gc = spec.group_columns
        g = bw // gc
        if scale is None:
            s = wp.reshape(-1, g, gc, bh).abs().amax(2).clamp_min(1e-12) / 7.0                 # (nb, G, bh)
            z = torch.full_like(s, 8.0)
        else:
            s = blocks_of(scale.to(torch.float32))[:, ::gc, :].contiguous()
            z = torch.full_like(s, 8.0) if zero is None else blocks_of(zero.to(torch.float32))[:, ::gc, :]
        step = s.repeat_interleave(gc, dim=1)
        lo = 1 if zero is None else 0                   # symmetric codes are -7..7 (u = q + 8)
        q = (torch.round(wp / step) + z.repeat_interleave(gc, dim=1)).clamp(lo, 15).to(torch.uint8)
        out["W"] = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).contiguous()
        out["S"] = s.contiguous()
        out["O"] = (-z * s).contiguous()
    if spec.dismantle != "full":
        out["C"] = torch.tensor([j for row in spec.rows for j in row] or [0], dtype=torch.int32)
    if spec.dismantle == "none":
        out["P"] = torch.tensor(spec.offsets() + [spec.n_blocks], dtype=torch.int32)
    return out


def dequantized_weight(spec: BlockLinearSpec, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense (N, K) fp32 weight the kernel computes with (after quantisation)."""
    bh, bw = spec.block
    if spec.weight_bits == 32:
        wp = packed["W"]
    elif spec.weight_bits == 8:
        rows = torch.cat([torch.arange(i * bh, (i + 1) * bh) for i, row in enumerate(spec.rows) for _ in row]) \
            if spec.n_blocks else torch.zeros(bh, dtype=torch.long)
        wp = packed["W"].to(torch.float32) * packed["WS"][rows].reshape(-1, 1, bh)
    else:
        b = packed["W"]
        u = torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], bw, bh).to(torch.float32)
        gc = spec.group_columns
        wp = u * packed["S"].repeat_interleave(gc, dim=1) + packed["O"].repeat_interleave(gc, dim=1)
    w = torch.zeros(spec.n // bh, bh, spec.k // bw, bw)
    p = 0
    for i, row in enumerate(spec.rows):
        for j in row:
            w[i, :, j, :] = wp[p].t()
            p += 1
    return w.reshape(spec.n, spec.k)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantisation of activations: (int8 values, fp32 scales)."""
    scale = x.abs().amax(1).clamp_min(1e-12) / 127.0
    return torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(torch.float32)


def reference(spec: BlockLinearSpec, x: torch.Tensor, packed: dict, bias=None, y=None) -> torch.Tensor:
    """What the kernel computes, in fp64 torch ops."""
    w = dequantized_weight(spec, packed).double()
    if spec.weight_bits == 8:
        q, s = quantize_rows(x)
        x = q.double() * s.double()[:, None]
    return torch_epilogue(spec, x.double() @ w.t(), bias, y)


# ---- the TIR template ---------------------------------------------------------------------------

def block_linear(spec: BlockLinearSpec):
    """The PrimFunc of ``spec`` (see module docstring); arguments in ``argument_names(spec)`` order."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    bh, bw = spec.block
    rv = vector_width(bh)
    nb = max(spec.n_blocks, 1) if spec.dismantle != "none" else tirx.Var("nb", "int32")  # generic: any count
    int8 = spec.weight_bits == 8
    acc_dt = "int32" if int8 else "float32"
    offsets = spec.offsets()
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(spec.name)
            T.func_attr({"tirx.noalias": True})
            X = T.arg("X", T.buffer((spec.m, spec.k), "int8" if int8 else "float32"))
            XS = T.arg("XS", T.buffer((spec.m,), "float32")) if int8 else None
            if spec.weight_bits == 4:
                W = T.arg("W", T.buffer((nb, bw, bh // 2), "uint8"))
                groups = bw // spec.group_columns
                S = T.arg("S", T.buffer((nb, groups, bh), "float32"))
                O = T.arg("O", T.buffer((nb, groups, bh), "float32"))
            else:
                W = T.arg("W", T.buffer((nb, bw, bh), "int8" if int8 else "float32"))
            WS = T.arg("WS", T.buffer((spec.n,), "float32")) if int8 else None
            C = T.arg("C", T.buffer((nb,), "int32")) if spec.dismantle != "full" else None
            P = T.arg("P", T.buffer((len(spec.rows) + 1,), "int32")) if spec.dismantle == "none" else None
            B = T.arg("B", T.buffer((spec.n,), "float32")) if spec.bias else None
            Y = T.arg("Y", T.buffer((spec.m, spec.n), "float32"))

            def weight(p, kk, r):
                if spec.weight_bits == 4:
                    byte = W[p, kk, r // 2]
                    nib = tirx.bitwise_and(tirx.shift_right(byte, (r % 2 * 4).astype("uint8")), tirx.const(15, "uint8"))
                    gi = kk // spec.group_columns if spec.group_columns < bw else 0
                    return nib.astype("float32") * S[p, gi, r] + O[p, gi, r]
                return W[p, kk, r].astype("int32") if int8 else W[p, kk, r]

            packed_x = {}  # inside a panel: the panel's X columns copied into a dense workspace

            def xval(m, col, kk):
                if packed_x:
                    u = packed_x["cols"].get(col, 0) if isinstance(col, int) else col
                    v = packed_x["xp"][u, m - packed_x["row0"], kk]
                else:
                    v = X[m, col * bw + kk]
                return v.astype("int32") if int8 else v

            def fma(acc, m0, mt, p, col, r0):
                with T.serial(0, bw) as kk:
                    with T.unroll(0, mt) as mi:
                        with T.vectorized(0, rv) as r:
                            T.buffer_store(acc, acc[mi, r] + xval(m0 + mi, col, kk) * weight(p, kk, r0 + r), [mi, r])

            def pack_panel(row0, group):
                """Copy the panel's rows of the block columns this group reads (the GEMM packing step):
                the micro-kernel then reads contiguous memory instead of rows K floats apart."""
                if spec.dismantle == "full":
                    used = sorted({j for bi in group for j in spec.rows[bi]})
                    cols = {j: u for u, j in enumerate(used)}
                else:
                    used, cols = list(range(spec.k // bw)), None
                if not used:
                    return
                xp = T.alloc_buffer((len(used), PANEL, bw), "int8" if int8 else "float32", scope="global")
                for u, j in enumerate(used):
                    with T.serial(0, PANEL) as r:
                        with T.If(row0 + r < (spec.m // MT) * MT):
                            with T.Then():
                                with T.vectorized(0, bw) as kk:
                                    T.buffer_store(xp, X[row0 + r, j * bw + kk], [u, r, kk])
                packed_x.update(xp=xp, row0=row0, cols=cols or {})

            def row_tile(acc, m0, mt, bi, rh):
                r0 = rh * rv
                with T.unroll(0, mt) as mi:
                    with T.vectorized(0, rv) as r:
                        T.buffer_store(acc, tirx.const(0, acc_dt), [mi, r])
                row = spec.rows[bi] if spec.dismantle != "none" else None
                if spec.dismantle == "full":  # every grid block, guarded by a compile-time constant
                    for j in range(spec.k // bw):
                        kept = j in row
                        with T.If(tirx.const(kept, "bool")):
                            with T.Then():
                                fma(acc, m0, mt, offsets[bi] + row.index(j) if kept else 0, j, r0)
                elif spec.dismantle == "tile" and row:
                    with T.serial(0, len(row)) as t:
                        fma(acc, m0, mt, offsets[bi] + t, C[offsets[bi] + t], r0)
                elif spec.dismantle == "none":
                    with T.serial(P[bi], P[bi + 1]) as p:
                        fma(acc, m0, mt, p, C[p], r0)
                with T.unroll(0, mt) as mi:
                    with T.vectorized(0, rv) as r:
                        col = bi * bh + r0 + r
                        v = acc[mi, r]
                        if int8:
                            v = v.astype("float32") * XS[m0 + mi] * WS[col]
                        if spec.accumulate:
                            v = v + Y[m0 + mi, col]
                        if spec.bias:
                            v = v + B[col]
                        T.buffer_store(Y, tir_activation(spec.activation, v), [m0 + mi, col])

            def block_row_loop(group):
                """Specialised kernels unroll the block rows (each gets its own constants);
                the generic one loops over them, so its code does not grow with N."""
                if spec.dismantle != "none":
                    yield from group
                    return
                with T.serial(0, len(spec.rows)) as bi:
                    yield bi

            tiles = spec.m // MT
            per_panel = PANEL // MT
            panels = -(-tiles // per_panel)
            for group in row_groups(spec):  # one parallel region each: LLVM's time grows with function size
                if tiles:  # block rows outside, the panel's tiles inside: a block row's weights stay in L1
                    with T.parallel(0, panels) as po:
                        acc = T.alloc_buffer((MT, rv), acc_dt, scope="global")  # global + small: a stack array
                        pack_panel(po * PANEL, group)
                        for bi in block_row_loop(group):
                            for rh in range(bh // rv):
                                with T.serial(0, per_panel) as mq:
                                    mo = po * per_panel + mq
                                    if tiles % per_panel:
                                        with T.If(mo < tiles):
                                            with T.Then():
                                                row_tile(acc, mo * MT, MT, bi, rh)
                                    else:
                                        row_tile(acc, mo * MT, MT, bi, rh)
                    packed_x.clear()
                if spec.m % MT:
                    acc = T.alloc_buffer((spec.m % MT, rv), acc_dt, scope="global")
                    for bi in block_row_loop(group):
                        for rh in range(bh // rv):
                            row_tile(acc, tiles * MT, spec.m % MT, bi, rh)
    return ib.get()


# Loop nests per parallel region. LLVM's time grows faster than linearly with a function's size
# (one region of 96 block rows: 21-46 s; in regions of ~64 nests: 7-8 s), while every extra
# region re-reads X. Measured on FFN1/FFN2 at 90% (benchmarks/RESULTS.md): these budgets keep
# compile under ~10 s and run time within the noise of a single region.
GROUP_WORK = {"full": 192, "tile": 64, "none": 10**9}


def row_groups(spec: BlockLinearSpec) -> list[list[int]]:
    """Consecutive block rows split so each parallel region emits about GROUP_WORK loop nests."""
    bh = spec.block[0]
    groups, cur, work = [], [], 0
    for bi, row in enumerate(spec.rows):
        nests = (bh // vector_width(bh)) * (1 + (len(row) if spec.dismantle == "full" else 1))
        if cur and work + nests > GROUP_WORK[spec.dismantle]:
            groups.append(cur)
            cur, work = [], 0
        cur.append(bi)
        work += nests
    return groups + ([cur] if cur else [])


def argument_names(spec: BlockLinearSpec) -> list[str]:
    names = ["X"] + (["XS"] if spec.weight_bits == 8 else []) + ["W"]
    names += ["S", "O"] if spec.weight_bits == 4 else []
    names += ["WS"] if spec.weight_bits == 8 else []
    names += ["C"] if spec.dismantle != "full" else []
    names += ["P"] if spec.dismantle == "none" else []
    names += ["B"] if spec.bias else []
    return names + ["Y"]
