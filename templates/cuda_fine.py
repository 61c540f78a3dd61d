"""Fine-grained (unstructured) sparse fp16 linear ``Y = act(X · Wᵀ + b)`` for CUDA, in TVMScript.

``W`` (N, K) is stored as CSR (row pointers, column indices, fp16 values) — its kept elements only,
for sparsity too scattered for blocks. One CTA owns ``tm`` rows of ``X`` and ``npb`` rows of ``W``
(output columns): it stages the X tile in shared memory (rows padded by one word, so the 32 lanes
of a warp — 32 different rows of X — read one column conflict-free), then each warp walks its
output columns: every lane reads the same (value, column) pair (one broadcast load) and
accumulates in fp32 ``W[n, c] · X[m, c]`` from shared memory. The ``tm × npb`` fp16 tile is staged
in shared memory and written in coalesced rows, with bias and activation fused.

It pays per kept element (a shared-memory read and an FMA on the CUDA cores, no tensor cores),
so it is for the high-sparsity end where blocks would carry mostly zeros.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .cuda_bsr import ACTIVATIONS
from .cuda_bsr_parts import tir_epilogue
from .cuda_bsr_ref import _activate


@dataclass(frozen=True)
class FineSpec:
    m: int
    n: int
    k: int
    tm: int = 32                # rows of X per CTA: 32 (one per lane) or 16 (two output columns per warp step)
    npb: int = 256              # output columns per CTA
    warps: int = 4
    bias: bool = True
    act: str = "none"
    name: str = "fine_linear"

    def __post_init__(self):
        bad = []
        if min(self.m, self.n, self.k) <= 0 or self.k % 8:
            bad.append(f"M, N, K must be positive and K={self.k} a multiple of 8")
        if self.tm not in (16, 32):
            bad.append("tm must be 16 or 32")
        if self.npb % (self.warps * (32 // self.tm)) or self.npb % 8:
            bad.append(f"npb={self.npb} must split evenly over {self.warps} warps and be a multiple of 8")
        if self.act not in ACTIVATIONS:
            bad.append(f"activation {self.act!r} not in {ACTIVATIONS}")
        if self.shared_bytes > 200 * 1024:
            bad.append(f"{self.shared_bytes} bytes of shared memory; lower tm or npb")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    @property
    def x_stride(self) -> int:
        return self.k + 2       # halves: one extra word per row shifts each row by one bank

    @property
    def shared_bytes(self) -> int:
        return 2 * (self.tm * self.x_stride + self.tm * (self.npb + 8))

    def key(self) -> dict:
        return asdict(self)


def pack_weight(w: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row_ptr, cols, vals)``: CSR of the kept (default: nonzero) elements of ``w`` (N, K), fp16
    values, int32 indices; ``cols``/``vals`` hold at least one entry."""
    keep = w.ne(0) if keep is None else keep.bool().to(w.device)
    counts = keep.sum(1)
    row_ptr = torch.zeros(w.shape[0] + 1, dtype=torch.int32, device=w.device)
    row_ptr[1:] = counts.cumsum(0)
    idx = keep.nonzero()
    cols = idx[:, 1].to(torch.int32)
    vals = w[keep].to(torch.float16)
    if cols.numel() == 0:
        cols, vals = torch.zeros(1, dtype=torch.int32, device=w.device), torch.zeros(1, dtype=torch.float16,
                                                                                      device=w.device)
    return row_ptr, cols.contiguous(), vals.contiguous()


def unpack_weight(row_ptr, cols, vals, n: int, k: int) -> torch.Tensor:
    """The dense (N, K) fp16 weight of a CSR triple."""
    w = torch.zeros(n, k, dtype=torch.float16, device=vals.device)
    counts = (row_ptr[1:] - row_ptr[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(n, device=vals.device), counts)
    nnz = int(row_ptr[-1])
    w[rows, cols[:nnz].long()] = vals[:nnz]
    return w


def reference(x: torch.Tensor, w: torch.Tensor, keep: torch.Tensor | None, bias, act: str) -> torch.Tensor:
    """What the kernel computes: fp32 from the fp16 operands, fp16 out."""
    w = w.half().float() * (keep.float().to(w.device) if keep is not None else 1.0)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return _activate(y, act).half()


def argument_names(spec: FineSpec) -> list[str]:
    return ["X", "RowPtr", "Cols", "Vals", *(["B"] if spec.bias else []), "Y"]


def fine_linear(spec: FineSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    M, N, K, TM, NPB, NW = spec.m, spec.n, spec.k, spec.tm, spec.npb, spec.warps
    NT, XS, OUT_LD = 32 * NW, spec.x_stride, spec.npb + 8
    LANE_GROUPS = 32 // TM                  # output columns a warp advances per step
    STEPS = NPB // (NW * LANE_GROUPS)
    X_CHUNKS = TM * (K // 8)
    X_ITERS = -(-X_CHUNKS // NT)
    OUT_CHUNKS = TM * (NPB // 8)
    OUT_ITERS = -(-OUT_CHUNKS // NT)
    use_bias, act = spec.bias, spec.act

    def epilogue(v, b):
        return tir_epilogue(v, b if use_bias else None, act)

    @T.prim_func
    def kernel(x_h: T.handle, rp_h: T.handle, c_h: T.handle, v_h: T.handle, b_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        nnz = T.int32()
        X = T.match_buffer(x_h, (M, K), "float16")
        RowPtr = T.match_buffer(rp_h, (N + 1,), "int32")
        Cols = T.match_buffer(c_h, (nnz,), "int32")
        Vals = T.match_buffer(v_h, (nnz,), "float16")
        B = T.match_buffer(b_h, (N,), "float16")
        Y = T.match_buffer(y_h, (M, N), "float16")
        bx = T.launch_thread("blockIdx.x", -(-M // TM))
        by = T.launch_thread("blockIdx.y", -(-N // NPB))
        tx = T.launch_thread("threadIdx.x", NT)
        smem = T.decl_buffer((TM * XS,), "float16", scope="shared.dyn")      # the X tile
        ys = T.decl_buffer((TM * OUT_LD,), "float16", scope="shared.dyn")    # the Y tile (merged after smem)
        chunk = T.alloc_buffer((8,), "float16", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        m0 = T.meta_var(bx * TM)
        n0 = T.meta_var(by * NPB)
        lane = T.meta_var(tx % 32)
        warp = T.meta_var(tx // 32)
        for it in T.unroll(X_ITERS):            # X tile: 16-byte loads, 4-byte stores into padded rows
            c = T.meta_var(tx + it * NT)
            if X_CHUNKS % NT == 0 or c < X_CHUNKS:
                r = T.meta_var(c // (K // 8))
                col = T.meta_var((c % (K // 8)) * 8)
                for v in T.vectorized(8):
                    chunk[v] = X[T.min(m0 + r, M - 1), col + v]
                for v in T.unroll(8):
                    smem[r * XS + col + v] = chunk[v]
        T.tvm_storage_sync("shared")
        for step in T.serial(STEPS):
            ln = T.meta_var((step * NW + warp) * LANE_GROUPS + lane // TM)   # local output column
            n = T.meta_var(n0 + ln)
            row = T.meta_var(lane % TM)
            acc[0] = T.float32(0)
            if n < N:
                for j in T.serial(RowPtr[n], RowPtr[n + 1]):
                    acc[0] = acc[0] + T.Cast("float32", Vals[j]) * T.Cast("float32", smem[row * XS + Cols[j]])
            ys[row * OUT_LD + ln] = epilogue(acc[0], B[T.min(n, N - 1)])
        T.tvm_storage_sync("shared")
        for it in T.unroll(OUT_ITERS):           # coalesced 16-byte rows out
            c = T.meta_var(tx + it * NT)
            if OUT_CHUNKS % NT == 0 or c < OUT_CHUNKS:
                yr = T.meta_var(m0 + c // (NPB // 8))
                yc = T.meta_var(n0 + (c % (NPB // 8)) * 8)
                if N % 8 == 0:
                    if yr < M and yc < N:
                        for v in T.vectorized(8):
                            Y[yr, yc + v] = ys[(c // (NPB // 8)) * OUT_LD + (c % (NPB // 8)) * 8 + v]
                else:
                    for v in T.unroll(8):
                        if yr < M and yc + v < N:
                            Y[yr, yc + v] = ys[(c // (NPB // 8)) * OUT_LD + (c % (NPB // 8)) * 8 + v]

    return tvm.IRModule({spec.name: kernel})
