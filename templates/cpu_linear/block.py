"""The CPU block-sparse linear (``block_spec.BlockLinearSpec``) as a TIR template, built with LLVM.

The kernel walks panels of ``PANEL`` rows of ``X`` in parallel (with fewer rows than two panels, the generic kernel
hands block rows to the threads instead); for each output block row and each ``RV``-wide slice of it, a ``MT × RV`` register tile accumulates ``x[m, k] · w[k, r]`` over the row's kept blocks (broadcast-FMA
micro-kernel, vectorised over ``r``), then the epilogue adds the bias, applies the activation and stores. How the kept
blocks are found is the spec's dismantle level (see ``block_spec.py``).
"""

from __future__ import annotations

from .block_spec import PANEL, BlockLinearSpec, vector_width
from .epilogue import tir_activation

MT = 4          # register-tile rows


def block_linear(spec: BlockLinearSpec):
    """The PrimFunc of ``spec`` (see module docstring); arguments in ``block_spec.argument_names(spec)`` order."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    bh, bw = spec.block
    rv = vector_width(bh)
    nb = max(spec.n_blocks, 1) if spec.dismantle != "none" else tirx.Var("nb", "int32")  # generic: any count
    int8 = spec.int8_activations            # int8 × int8 → int32; int8 weights with fp32 activations accumulate fp32
    w8 = spec.weight_bits == 8
    acc_dt = "int32" if int8 else "float32"
    offsets = spec.offsets()
    symbolic = spec.m == 0                 # any number of rows: M is an argument of the kernel
    m = tirx.Var("m", "int32") if symbolic else spec.m
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(spec.name)
            T.func_attr({"tirx.noalias": True})
            X = T.arg("X", T.buffer((m, spec.k), "int8" if int8 else "float32"))
            XS = T.arg("XS", T.buffer((m,), "float32")) if int8 else None
            if spec.weight_bits == 4:
                W = T.arg("W", T.buffer((nb, bw, bh // 2), "uint8"))
                groups = bw // spec.group_columns
                S = T.arg("S", T.buffer((nb, groups, bh), "float32"))
                O = T.arg("O", T.buffer((nb, groups, bh), "float32"))
            else:
                W = T.arg("W", T.buffer((nb, bw, bh), "int8" if w8 else "float32"))
            WS = T.arg("WS", T.buffer((spec.n,), "float32")) if w8 else None
            C = T.arg("C", T.buffer((nb,), "int32")) if spec.dismantle != "full" else None
            P = T.arg("P", T.buffer((len(spec.rows) + 1,), "int32")) if spec.dismantle == "none" else None
            B = T.arg("B", T.buffer((spec.n,), "float32")) if spec.bias else None
            Y = T.arg("Y", T.buffer((m, spec.n), "float32"))

            def int4_weight(p, kk, r0, high, r):
                """Row ``r0 + high·RV/2 + r`` of a register slice: the low (high) nibbles of the slice's RV/2 bytes
                hold its first (second) half, so both halves load contiguous bytes and shift them alike."""
                byte = W[p, kk, r0 // 2 + r]
                nib = tirx.bitwise_and(tirx.shift_right(byte, tirx.const(4 * high, "uint8")), tirx.const(15, "uint8"))
                gi = kk // spec.group_columns if spec.group_columns < bw else 0
                row = r0 + high * (rv // 2) + r
                return nib.astype("float32") * S[p, gi, row] + O[p, gi, row]

            def weight(p, kk, r):
                if w8:
                    return W[p, kk, r].astype("int32" if int8 else "float32")
                return W[p, kk, r]

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
                        if spec.weight_bits == 4:
                            half = rv // 2
                            for high in (0, 1):
                                with T.vectorized(0, half) as r:
                                    lane = high * half + r
                                    T.buffer_store(acc, acc[mi, lane] + xval(m0 + mi, col, kk)
                                                   * int4_weight(p, kk, r0, high, r), [mi, lane])
                        else:
                            with T.vectorized(0, rv) as r:
                                T.buffer_store(acc, acc[mi, r] + xval(m0 + mi, col, kk) * weight(p, kk, r0 + r),
                                               [mi, r])

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
                        with T.If(row0 + r < (m // MT) * MT):
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
                        elif w8:
                            v = v * WS[col]
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

            tiles = m // MT
            rest = m % MT
            per_panel = PANEL // MT
            panels = (tiles + per_panel - 1) // per_panel

            def tail_rows(acc, bi, rh):
                """The last ``m % MT`` rows: one unrolled tile at a known row count, one row at a time otherwise."""
                if not symbolic:
                    if rest:
                        row_tile(acc, tiles * MT, rest, bi, rh)
                    return
                with T.serial(0, rest) as r:
                    row_tile(acc, tiles * MT + r, 1, bi, rh)

            def by_block_rows():    # few rows (decode): threads take block rows, each streams its own weights
                with T.parallel(0, len(spec.rows)) as bi:
                    acc = T.alloc_buffer((MT, rv), acc_dt, scope="global")
                    for rh in range(bh // rv):
                        if symbolic or tiles:
                            with T.serial(0, tiles) as mo:
                                row_tile(acc, mo * MT, MT, bi, rh)
                        tail_rows(acc, bi, rh)

            def by_panels():
                for group in row_groups(spec):  # one parallel region each: LLVM's time grows with function size
                    if symbolic or tiles:  # block rows outside, the panel's tiles inside: their weights stay in L1
                        with T.parallel(0, panels) as po:
                            acc = T.alloc_buffer((MT, rv), acc_dt, scope="global")  # global + small: a stack array
                            pack_panel(po * PANEL, group)
                            for bi in block_row_loop(group):
                                for rh in range(bh // rv):
                                    with T.serial(0, per_panel) as mq:
                                        mo = po * per_panel + mq
                                        if symbolic or tiles % per_panel:
                                            with T.If(mo < tiles):
                                                with T.Then():
                                                    row_tile(acc, mo * MT, MT, bi, rh)
                                        else:
                                            row_tile(acc, mo * MT, MT, bi, rh)
                        packed_x.clear()
                    if symbolic or rest:
                        acc = T.alloc_buffer((MT, rv), acc_dt, scope="global")
                        for bi in block_row_loop(group):
                            for rh in range(bh // rv):
                                tail_rows(acc, bi, rh)

            if symbolic and spec.dismantle == "none":   # the row count decides at run time
                with T.If(m < 2 * PANEL):
                    with T.Then():
                        by_block_rows()
                    with T.Else():
                        by_panels()
            elif spec.row_parallel:
                by_block_rows()
            else:
                by_panels()
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
