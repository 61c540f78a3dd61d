"""The FP8 GEMV's packed weight dequantised into a dense 16-bit ``(N, K)`` matrix, for cuBLAS at many rows.

An FP8 linear's calls of many rows (prefill) run cuBLAS over ``code × scale``, written by this kernel into a transient
buffer right before the GEMM from the packed weight the GEMV reads (``spec.py``'s layout), so the model keeps its
1-byte codes only. A CTA owns a block row and ``cols`` block columns of W (many small CTAs: every SM busy, a short
last wave); a thread takes 16 codes of one row of a block (one 16-byte load), a warp 4 rows of 4 blocks side by side
(128 contiguous bytes of each block read, 256 of each row written). Each code goes E4M3 → fp16
(``cvt.rn.f16x2.e4m3x2``, exact) → fp32, times the fp32 scale, rounded once to the 16-bit type (bit for bit
``dequantize(...)`` cast to it); two 16-byte stores (4- or 8-byte ones where K % 8 != 0, 2-byte ones for an odd K).
Block-sparse: the CTA first maps its block columns to their stored blocks (the block row's table scanned into shared
memory); a pruned block is written as zeros.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .spec import (BLOCK, DTYPES, SCALE_BLOCK, SCALES, WORDS, Fp8GemvError, Fp8GemvSpec, Fp8Packed, check_packed,
                   dequantize)
from ...runtime.cuda import CudaKernel, CudaRuntimeError, lanes16

THREADS = 256
PIECE = 16                    # codes a thread decodes at a time: one 16-byte load, two 16-byte stores
SPAN = 4                      # block columns of a warp's 32 pieces (4 rows of each)


@dataclass(frozen=True)
class Fp8DequantSpec:
    """Shape and format of the packed weight (those of the GEMV spec it serves) and the CTA's width."""
    n: int
    k: int
    dtype: str = "bfloat16"   # the output's: "float16" or "bfloat16"
    sparse: bool = False      # block-sparse (32×32 blocks and a table) or dense
    scale: str = "channel"    # fp32 per output row, or per 128×128 block ("block")
    cols: int = 4             # block columns per CTA (a CTA: one block row of them)
    name: str = "fp8_dequant"

    def __post_init__(self):
        bad = []
        if self.n <= 0 or self.k <= 0:
            bad.append(f"N={self.n} and K={self.k} must be positive")
        if self.dtype not in DTYPES:
            bad.append(f"dtype {self.dtype!r} must be one of {tuple(DTYPES)}")
        if self.scale not in SCALES:
            bad.append(f"scale {self.scale!r} must be one of {SCALES}")
        if self.cols not in (1, 2, 4, 8, 16, 32):
            bad.append(f"cols={self.cols} must be 1, 2, 4, 8, 16 or 32")
        if bad:
            raise Fp8GemvError(f"FP8 dequant spec {self.name}: " + "; ".join(bad))

    @classmethod
    def for_gemv(cls, spec: Fp8GemvSpec) -> Fp8DequantSpec:
        """The dequantisation of ``spec``'s packed weight."""
        return cls(spec.n, spec.k, spec.dtype, spec.sparse, spec.scale,
                   name=f"fp8_dequant_{spec.n}x{spec.k}{'_sparse' if spec.sparse else ''}"
                        f"{'_block' if spec.scale == 'block' else ''}{'_bf16' if spec.dtype == 'bfloat16' else ''}")

    @property
    def gemv(self) -> Fp8GemvSpec:
        """A GEMV spec of the same packed weight (its checks and reference)."""
        return Fp8GemvSpec(self.n, self.k, dtype=self.dtype, sparse=self.sparse, scale=self.scale, name=self.name)

    @property
    def archs(self) -> tuple[str, ...]:
        return self.gemv.archs             # cvt.rn.f16x2.e4m3x2: sm_89 or later

    @property
    def row_blocks(self) -> int:
        return self.gemv.row_blocks

    @property
    def col_blocks(self) -> int:
        return self.gemv.col_blocks

    @property
    def tile_cols(self) -> int:
        """Block columns of a CTA's tile."""
        return min(self.cols, self.col_blocks)

    @property
    def pieces(self) -> int:
        """16-code pieces of a CTA's tile (whole groups of a warp's ``SPAN`` block columns)."""
        span = min(SPAN, self.tile_cols)
        return -(-self.tile_cols // span) * span * BLOCK * 2

    def key(self) -> dict:
        return asdict(self)


def fp8_dequant(spec: Fp8DequantSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``: ``(Wp, [Tab], S, W)``."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    from ..ptx import from_f32
    from .kernel import e4m3x2, half_f32

    N, K, ACT = spec.n, spec.k, spec.dtype
    NBR, KB, CB = spec.row_blocks, spec.col_blocks, spec.tile_cols
    TILES = -(-KB // CB)                          # tiles of block columns in a block row
    C = min(SPAN, CB)                             # block columns of a warp's pieces
    PIECES = spec.pieces                          # by (group of C blocks, row, block, half): p -> r, cl
    NT = min(THREADS, PIECES)
    IT = -(-PIECES // NT)
    SPARSE, BSCALE, SB = spec.sparse, spec.scale == "block", SCALE_BLOCK // BLOCK
    V = math.gcd(K, 8)                            # rows of W start 2V-byte aligned: 2V-byte stores (16 if K % 8 == 0)
    WSHAPE = (tirx.Var("wlen", "int32"),) if SPARSE else (NBR * KB * WORDS,)
    TSHAPE = (tirx.Var("ntab", "int32"),)

    @T.macro
    def store(W, ob, row, c0):
        # the piece's 16 values into W[row, c0 ..] (none past K: K is a multiple of V)
        for q in T.unroll(PIECE // V):
            if K % BLOCK == 0 or c0 + V * q < K:
                for v in T.vectorized(V):
                    W[row, c0 + V * q + v] = ob[V * q + v]

    @T.prim_func
    def kernel(w_h: T.handle, tab_h: T.handle, s_h: T.handle, o_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        Wp = T.match_buffer(w_h, WSHAPE, "int32")
        Tab = T.match_buffer(tab_h, TSHAPE, "int32")
        S = T.match_buffer(s_h, spec.gemv.scale_shape, "float32")
        W = T.match_buffer(o_h, (N, K), "float16")
        bx = T.launch_thread("blockIdx.x", NBR * TILES)
        tx = T.launch_thread("threadIdx.x", NT)
        slot = T.alloc_buffer((CB,), "int32", scope="shared")    # sparse: the stored block of each column, or -1
        wv = T.alloc_buffer((IT * 4,), "int32", scope="local")
        blk = T.alloc_buffer((IT,), "int32", scope="local")    # a piece's block: stored, -1 pruned, -2 none
        tc = T.alloc_buffer((1,), "int32", scope="local")
        hb = T.alloc_buffer((1,), "uint32", scope="local")
        sc = T.alloc_buffer((IT,), "float32", scope="local")
        pf = T.alloc_buffer((2,), "float32", scope="local")
        ob = T.alloc_buffer((PIECE,), "float16", scope="local")
        rb = T.meta_var(bx // TILES)
        cb0 = T.meta_var(bx % TILES * CB)
        if SPARSE:                                # the block row's kept blocks that fall in this tile
            if tx < CB:
                slot[tx] = -1
            T.tvm_storage_sync("shared")
            for j in T.serial((Tab[rb + 1] - Tab[rb] - tx + NT - 1) // NT):
                tc[0] = Tab[NBR + 1 + Tab[rb] + tx + j * NT] - cb0
                if 0 <= tc[0] and tc[0] < CB:
                    slot[tc[0]] = Tab[rb] + tx + j * NT
            T.tvm_storage_sync("shared")
        for it in T.unroll(IT):                   # every piece's loads in flight before the first decode
            p = T.meta_var(it * NT + tx)
            r = T.meta_var(p // (2 * C) % BLOCK)
            cl = T.meta_var(p // (2 * C * BLOCK) * C + p // 2 % C)
            blk[it] = -2
            if (PIECES % NT == 0 or p < PIECES) and (N % BLOCK == 0 or rb * BLOCK + r < N) \
                    and (CB % C == 0 or cl < CB) and (KB % CB == 0 or cb0 + cl < KB):
                if SPARSE:
                    blk[it] = slot[cl]
                else:
                    blk[it] = rb * KB + cb0 + cl
                if blk[it] >= 0:
                    for v in T.vectorized(4):
                        wv[it * 4 + v] = Wp[blk[it] * WORDS + r * (BLOCK // 4) + p % 2 * 4 + v]
                    if BSCALE:
                        sc[it] = S[(rb * BLOCK + r) // SCALE_BLOCK, (cb0 + cl) // SB]
                    else:
                        sc[it] = S[rb * BLOCK + r]
        for it in T.unroll(IT):
            p = T.meta_var(it * NT + tx)
            r = T.meta_var(p // (2 * C) % BLOCK)
            cl = T.meta_var(p // (2 * C * BLOCK) * C + p // 2 % C)
            if blk[it] >= -1:
                if not SPARSE or blk[it] >= 0:
                    for q in T.unroll(4):         # word q: codes 4q .. 4q+3, a cvt per pair
                        for hp in T.unroll(2):
                            hb[0] = e4m3x2(T.shift_right(T.Cast("uint32", wv[it * 4 + q]), T.uint32(16 * hp)))
                            pf[0] = half_f32(hb[0], False) * sc[it]
                            pf[1] = half_f32(hb[0], True) * sc[it]
                            ob[q * 4 + hp * 2] = from_f32(pf[0], ACT)
                            ob[q * 4 + hp * 2 + 1] = from_f32(pf[1], ACT)
                else:
                    for e in T.unroll(PIECE):
                        ob[e] = T.float16(0)
                store(W, ob, rb * BLOCK + r, (cb0 + cl) * BLOCK + p % 2 * PIECE)

    func = kernel
    if not SPARSE:
        func = tirx.PrimFunc([a for a in kernel.params if a.name != "tab_h"], kernel.body, kernel.ret_type,
                             kernel.attrs)
    return tvm.IRModule({spec.name: func})


def dequant_ref(packed: Fp8Packed, spec: Fp8DequantSpec, device=None) -> torch.Tensor:
    """What the kernel writes: ``dequantize(...)`` (fp32 code × scale, zeros where pruned) rounded once to the
    16-bit type, on ``device`` (default: the codes')."""
    device = packed.codes.device if device is None else device
    return dequantize(packed, spec.gemv, device).to(DTYPES[spec.dtype])


class Fp8DequantOp:
    """The kernel on device tensors: ``op(packed, out=None)`` writes the dense ``(N, K)`` weight into ``out`` (made if
    None) and returns it. No host synchronisation, nothing allocated when ``out`` is given: capturable in CUDA
    graphs (call it once before capturing: the first call loads the kernel)."""

    def __init__(self, folder, spec: Fp8DequantSpec):
        self.kernel, self.spec, self.gemv = CudaKernel(folder), spec, spec.gemv
        self.dtype = DTYPES[spec.dtype]
        self._prepared = None

    def __call__(self, packed: Fp8Packed, out: torch.Tensor | None = None) -> torch.Tensor:
        s, where = self.spec, f"FP8 dequant {self.spec.name}"
        check_packed(self.gemv, packed, check_bias=False)
        codes = packed.codes
        if not all(t.is_cuda and t.device == codes.device for t in packed.tensors()):
            raise CudaRuntimeError(f"{where} runs on a CUDA GPU: the packed tensors must be on one CUDA device, got "
                                   f"{sorted({str(t.device) for t in packed.tensors()})}")
        if out is None:
            out = torch.empty(s.n, s.k, dtype=self.dtype, device=codes.device)
        elif tuple(out.shape) != (s.n, s.k) or out.dtype != self.dtype or out.device != codes.device \
                or not out.is_contiguous():
            raise Fp8GemvError(f"{where}: the output must be a contiguous {self.dtype} ({s.n}, {s.k}) tensor on "
                               f"{codes.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
                               f"{'' if out.is_contiguous() else ' (not contiguous)'}")
        if codes.data_ptr() % 16 or out.data_ptr() % (2 * math.gcd(s.k, 8)):
            raise Fp8GemvError(f"{where}: the codes must be 16-byte aligned, the output {2 * math.gcd(s.k, 8)}-byte "
                               "aligned (its vector loads and stores)")
        tensors = dict(Wp=codes, **({"Tab": packed.table} if s.sparse else {}), S=packed.scales, W=lanes16(out))
        if self._prepared is None:
            self._prepared = self.kernel.prepare(tuple(tensors), **tensors)
        else:
            self._prepared.launch(**tensors)
        return out


def build_dequant(spec: Fp8DequantSpec, out: str | Path | None = None) -> Path:
    """Build ``spec``'s kernel (cached); ``out``: also copy its folder to ``out/<spec.name>``. Returns the folder."""
    from ...codegen.cuda_build import built_folder
    return built_folder(fp8_dequant, spec, out)


__all__ = ["Fp8DequantSpec", "Fp8DequantOp", "fp8_dequant", "dequant_ref", "build_dequant"]
