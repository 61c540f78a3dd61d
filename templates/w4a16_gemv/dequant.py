"""The W4A16 GEMV's packed weight dequantised into a dense 16-bit ``(N, K)`` matrix, for cuBLAS at many rows.

A 4-bit linear's calls of many rows (prefill) run cuBLAS over ``(q - zero) · scale``, written by this kernel into a
transient buffer right before the GEMM from the packed weight the GEMV reads (``spec.py``'s layout), so the model
keeps 4-bit weights only. A thread takes one lane's record (``Wq[tile, chunk, lane, :]``: 32 nibbles of one row,
one 16-byte load), dequantises it with the GEMV's ``lop3`` words (``ptx.dequant_word``: one rounding, bit for bit
``dequantize(...)`` rounded to the 16-bit type) and writes 64 contiguous bytes as four 16-byte stores.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .spec import KCHUNK, W4A16Spec, dequantize
from ...runtime.cuda import CudaKernel, CudaRuntimeError, lanes16

THREADS = 256


@dataclass(frozen=True)
class W4DequantSpec:
    """Shape and quantisation of the packed weight (those of the GEMV spec it serves)."""
    n: int
    k: int
    group: int = 128
    sym: bool = True
    dtype: str = "float16"            # the output's 16-bit type (and the scales')
    name: str = "w4a16_dequant"

    def __post_init__(self):
        W4A16Spec(0, self.n, self.k, group=self.group, sym=self.sym, dtype=self.dtype, rows=1)  # same checks

    @classmethod
    def for_gemv(cls, spec: W4A16Spec) -> W4DequantSpec:
        return cls(spec.n, spec.k, spec.group, spec.sym, spec.dtype,
                   f"w4a16_dequant_{spec.n}x{spec.k}_g{spec.group}{'' if spec.sym else '_zero'}"
                   f"{'_bf16' if spec.dtype == 'bfloat16' else ''}")

    @property
    def gemv(self) -> W4A16Spec:
        """A GEMV spec of the same packed layout (tiles, chunks, groups)."""
        return W4A16Spec(0, self.n, self.k, group=self.group, sym=self.sym, dtype=self.dtype, rows=1)

    def key(self) -> dict:
        return asdict(self)


def w4a16_dequant(spec: W4DequantSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``: ``(Wq, S, [Z], W)``."""
    import tvm
    from tvm.script import tirx as T

    from ..ptx import dequant_word, half2_splat, zero_terms
    g_spec = spec.gemv
    N, K, G, ACT, sym = spec.n, spec.k, spec.group, spec.dtype, spec.sym
    TILES, KC, NG = g_spec.tiles, g_spec.chunks, g_spec.groups
    RECORDS = TILES * KC * 32
    FULL = RECORDS % THREADS == 0
    dequant = dequant_word(scaled=True, act16=ACT)

    @T.prim_func
    def kernel(wq_h: T.handle, s_h: T.handle, z_h: T.handle, w_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        Wq = T.match_buffer(wq_h, (TILES, KC, 32, 4), "int32")
        S = T.match_buffer(s_h, (TILES, NG, 8), "float16")
        Z = T.match_buffer(z_h, (TILES, NG, 8), "uint8")
        W = T.match_buffer(w_h, (N, K), "float16")
        bx = T.launch_thread("blockIdx.x", -(-RECORDS // THREADS))
        tx = T.launch_thread("threadIdx.x", THREADS)
        wq = T.alloc_buffer((4,), "uint32", scope="local")
        b = T.alloc_buffer((16,), "uint32", scope="local")
        bh = T.decl_buffer((32,), "float16", data=b.data, scope="local")
        zt = T.alloc_buffer((3,), "uint32", scope="local")           # zero terms, then the scale as half2
        rec = T.meta_var(bx * THREADS + tx)
        lane = T.meta_var(rec % 32)
        chunk = T.meta_var(rec // 32 % KC)
        tile = T.meta_var(rec // (32 * KC))
        row = T.meta_var(tile * 8 + lane // 4)
        col = T.meta_var(chunk * KCHUNK + lane % 4 * 32)     # K is a multiple of 32: a record is in or out
        if (FULL or rec < RECORDS) and (N % 8 == 0 or row < N) and (K % KCHUNK == 0 or col < K):
            T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                wq[0], wq[1], wq[2], wq[3], Wq.ptr_to([tile, chunk, lane, 0])))
            if sym:
                zt[0] = zero_terms(None, ACT)[0]
                zt[1] = zero_terms(None, ACT)[1]
            else:
                zt[0] = zero_terms(T.Cast("uint32", Z[tile, col // G, lane // 4]), ACT)[0]
                zt[1] = zero_terms(T.Cast("uint32", Z[tile, col // G, lane // 4]), ACT)[1]
            zt[2] = half2_splat(S[tile, col // G, lane // 4])
            for j in T.unroll(4):
                dequant(b, 4 * j, wq[j], zt[2], zt[0], zt[1])
            for j in T.unroll(4):
                for v in T.vectorized(8):
                    W[row, col + 8 * j + v] = bh[8 * j + v]

    return tvm.IRModule({spec.name: kernel})


def dequant_ref(wq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: W4DequantSpec) -> torch.Tensor:
    """What the kernel writes: the GEMV's ``(q - zero) · scale`` rounded once to the 16-bit type."""
    return dequantize(wq, scale, zero, spec.gemv).to(torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16)


class W4DequantOp:
    """The kernel on device tensors: ``op(wq, scale, zero, out=None)`` writes the dense ``(N, K)`` weight into
    ``out`` (made if None) and returns it. No host synchronisation: capturable in CUDA graphs."""

    def __init__(self, folder, spec: W4DequantSpec):
        self.kernel, self.spec = CudaKernel(folder), spec
        self.dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float16
        self._prepared = None

    def __call__(self, wq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        if out is None:
            out = torch.empty(s.n, s.k, dtype=self.dtype, device=wq.device)
        elif tuple(out.shape) != (s.n, s.k) or out.dtype != self.dtype or out.device != wq.device \
                or not out.is_contiguous():
            raise CudaRuntimeError(f"{s.name}: the output must be a contiguous {self.dtype} ({s.n}, {s.k}) tensor on "
                                   f"{wq.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        tensors = dict(Wq=wq, S=lanes16(scale), W=lanes16(out), **({} if s.sym else {"Z": zero}))
        if self._prepared is None:
            self._prepared = self.kernel.prepare(tuple(tensors), **tensors)
        else:
            self._prepared.launch(**tensors)
        return out


def build_dequant(spec: W4DequantSpec, out: str | Path | None = None) -> Path:
    """Build ``spec``'s kernel (cached); ``out``: also copy its folder to ``out/<spec.name>``."""
    from ...codegen.cuda_build import built_folder
    return built_folder(w4a16_dequant, spec, out)


__all__ = ["W4DequantSpec", "W4DequantOp", "w4a16_dequant", "dequant_ref", "build_dequant"]
