"""Quantized GEMV with ``dp4a`` (llama.cpp's ``quantize_q8_1`` + ``mul_mat_vec_q`` for q4_0), in TVMScript.

``Y = X̂ · Ŵᵀ (+ b)`` for a few activation rows (decode, ``M ≤ 8``), everything in blocks of 32 along K:

- weights: int4, symmetric per block (q4_0): nibble ``u ∈ [0, 15]``, ``w = (u − 8) · d_w``, ``d_w`` fp16.
  A block is 16 bytes = 4 words; word ``i`` holds elements ``4i … 4i+3`` in its low nibbles and
  ``16+4i … 16+4i+3`` in its high nibbles, so ``word & 0x0F0F0F0F`` and ``(word >> 4) & 0x0F0F0F0F``
  are four bytes each that one ``dp4a`` multiplies with four activation codes.
- activations: int8 per block (q8_1), quantised on the fly by :func:`quantize_q8_kernel`:
  ``q = round(x / d_x)``, ``d_x = max|x| · (1/127)``, and ``s_x = d_x · Σq`` stored beside ``d_x``.
- ``y = Σ_blocks d_w · (d_x · Σ u·q − 8 · s_x)``: 8 ``dp4a`` per block and row, fp32 across blocks.

One warp per output row: each lane issues all its 16-byte weight loads first (blocks ``lane``,
``lane + 32``, …), then the dot products for every activation row, then a butterfly shuffle
reduction. Weight bytes dominate: ≈ 4.5 bits per weight move once, whatever ``M``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .cuda_quant import int8_code, int8_scale

BLOCK = 32


@dataclass(frozen=True)
class Q4GemvSpec:
    m: int                      # activation rows (1..8): each weight load serves all of them
    n: int
    k: int                      # a multiple of 32
    warps: int = 4              # output rows per CTA
    bias: bool = False
    name: str = "q4_gemv"

    def __post_init__(self):
        bad = []
        if not 1 <= self.m <= 8:
            bad.append(f"M={self.m} must be 1..8 (a GEMV for decode; larger batches want a GEMM)")
        if self.n <= 0 or self.k <= 0 or self.k % BLOCK:
            bad.append(f"N and K must be positive and K={self.k} a multiple of {BLOCK}")
        if self.warps not in (1, 2, 4, 8, 16):
            bad.append("warps must be 1, 2, 4, 8 or 16")
        if bad:
            raise ValueError(f"spec {self.name}: " + "; ".join(bad))

    def key(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Q8QuantSpec:
    m: int
    k: int                      # a multiple of 32
    threads: int = 128          # one 32-element block per thread
    name: str = "quantize_q8"

    def __post_init__(self):
        if self.m <= 0 or self.k <= 0 or self.k % BLOCK:
            raise ValueError(f"spec {self.name}: M and K must be positive and K={self.k} a multiple of {BLOCK}")

    def key(self) -> dict:
        return asdict(self)


def argument_names(spec) -> list[str]:
    if isinstance(spec, Q8QuantSpec):
        return ["X", "XQ", "XD"]
    return ["XQ", "XD", "Wq", "Dw", *(["B"] if spec.bias else []), "Y"]


# ---- torch side: packing, quantisation, reference --------------------------------------------

def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq, Dw)``: int4 codes packed 8 per int32 word, ``(N, K/8)``, and fp16 block scales ``(N, K/32)``
    (``d_w = max|w| / 7`` rounded to fp16, codes ``clamp(round(w / d_w), −8, 7) + 8``)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"K={k} must be a multiple of {BLOCK}")
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / 7).half()
    u = (torch.round(blocks / d.float().clamp_min(1e-30)[..., None]).clamp(-8, 7) + 8).to(torch.uint8)
    packed = (u[..., :16] | (u[..., 16:] << 4)).contiguous()            # byte j: element j, element 16 + j
    return packed.view(torch.int32).reshape(n, k // 8), d


def dequantize_weight(wq: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """The fp32 ``(N, K)`` weight the kernel applies."""
    n = wq.shape[0]
    b = wq.contiguous().view(torch.uint8).reshape(n, -1, 16)
    u = torch.cat([b & 0xF, b >> 4], dim=-1).float()
    return ((u - 8) * dw.float()[..., None]).reshape(n, -1)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(XQ, XD)``: int8 codes ``(M, K)`` and per-block ``(d_x, d_x·Σq)`` fp32 ``(M, K/32, 2)`` — bit for bit
    what the quantiser kernel writes (fp32 division, round half to even)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1).clamp_min(1e-12) * (1.0 / 127.0)
    q = torch.round(blocks / d[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(m, k), torch.stack([d, d * q.sum(-1)], dim=-1)


def reference(x: torch.Tensor, wq: torch.Tensor, dw: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernels compute: q8 activations times q4 weights, fp32, fp16 out."""
    xq, xd = quantize_q8(x)
    xh = (xq.float().reshape(*xd.shape[:2], BLOCK) * xd[..., :1]).reshape(x.shape)
    y = xh @ dequantize_weight(wq, dw).t()
    if bias is not None:
        y = y + bias.float()
    return y.half()


# ---- kernels -----------------------------------------------------------------------------------

def quantize_q8_kernel(spec: Q8QuantSpec):
    """The q8 activation quantiser as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    M, K, NT = spec.m, spec.k, spec.threads
    KB = K // BLOCK

    @T.prim_func
    def kernel(x_h: T.handle, xq_h: T.handle, xd_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        X = T.match_buffer(x_h, (M, K), "float16")
        XQ = T.match_buffer(xq_h, (M, K), "int8")
        XD = T.match_buffer(xd_h, (M, KB, 2), "float32")
        row = T.launch_thread("blockIdx.x", M)
        by = T.launch_thread("blockIdx.y", -(-KB // NT))
        tx = T.launch_thread("threadIdx.x", NT)
        vals = T.alloc_buffer((BLOCK,), "float16", scope="local")
        codes = T.alloc_buffer((BLOCK,), "int8", scope="local")
        st = T.alloc_buffer((3,), "float32", scope="local")        # max, scale, sum of codes
        kb = T.meta_var(by * NT + tx)
        if kb < KB:
            for c in T.unroll(4):
                for v in T.vectorized(8):
                    vals[c * 8 + v] = X[row, kb * BLOCK + c * 8 + v]
            st[0] = T.float32(0)
            for v in T.unroll(BLOCK):
                st[0] = T.max(st[0], T.abs(T.Cast("float32", vals[v])))
            st[1] = int8_scale(st[0])
            st[2] = T.float32(0)
            for v in T.unroll(BLOCK):
                codes[v] = int8_code(T.Cast("float32", vals[v]) / st[1])
                st[2] = st[2] + T.Cast("float32", codes[v])
            for c in T.unroll(2):
                for v in T.vectorized(16):
                    XQ[row, kb * BLOCK + c * 16 + v] = codes[c * 16 + v]
            XD[row, kb, 0] = st[1]
            XD[row, kb, 1] = st[1] * st[2]

    return tvm.IRModule({spec.name: kernel})


def q4_gemv(spec: Q4GemvSpec):
    """The dp4a GEMV as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    M, N, K, W = spec.m, spec.n, spec.k, spec.warps
    KB = K // BLOCK
    IT = -(-KB // 32)                       # blocks per lane
    use_bias = spec.bias

    @T.prim_func
    def kernel(xq_h: T.handle, xd_h: T.handle, wq_h: T.handle, dw_h: T.handle, b_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        XQ = T.match_buffer(xq_h, (M, K // 4), "int32")           # int8 codes, four per word
        XD = T.match_buffer(xd_h, (M, KB, 2), "float32")
        Wq = T.match_buffer(wq_h, (N, K // 8), "int32")
        Dw = T.match_buffer(dw_h, (N, KB), "float16")
        B = T.match_buffer(b_h, (N,), "float16")
        Y = T.match_buffer(y_h, (M, N), "float16")
        bx = T.launch_thread("blockIdx.x", -(-N // W))
        tx = T.launch_thread("threadIdx.x", 32 * W)
        wv = T.alloc_buffer((IT * 4,), "int32", scope="local")
        dw = T.alloc_buffer((IT,), "float32", scope="local")
        xw = T.alloc_buffer((8,), "int32", scope="local")
        acc = T.alloc_buffer((1,), "int32", scope="local")
        part = T.alloc_buffer((M,), "float32", scope="local")
        other = T.alloc_buffer((1,), "float32", scope="local")
        lane = T.meta_var(tx % 32)
        n = T.meta_var(bx * W + tx // 32)
        if n < N:
            for it in T.unroll(IT):                  # every weight load in flight before the first use
                if KB % 32 == 0 or lane + it * 32 < KB:
                    for v in T.vectorized(4):
                        wv[it * 4 + v] = Wq[n, (lane + it * 32) * 4 + v]
                    dw[it] = T.Cast("float32", Dw[n, lane + it * 32])
            for m in T.unroll(M):
                part[m] = T.float32(0)
            for it in T.unroll(IT):
                if KB % 32 == 0 or lane + it * 32 < KB:
                    kb = T.meta_var(lane + it * 32)
                    for m in T.unroll(M):
                        for v in T.vectorized(8):
                            xw[v] = XQ[m, kb * 8 + v]
                        acc[0] = 0
                        for i in T.unroll(4):
                            T.evaluate(T.ptx["dp4a.u32.s32"](acc[0], T.bitwise_and(
                                T.Cast("uint32", wv[it * 4 + i]), T.uint32(0x0F0F0F0F)), xw[i], acc[0]))
                            T.evaluate(T.ptx["dp4a.u32.s32"](acc[0], T.bitwise_and(T.shift_right(
                                T.Cast("uint32", wv[it * 4 + i]), T.uint32(4)), T.uint32(0x0F0F0F0F)), xw[4 + i],
                                acc[0]))
                        part[m] = part[m] + dw[it] * (XD[m, kb, 0] * T.Cast("float32", acc[0])
                                                      - T.float32(8) * XD[m, kb, 1])
            for m in T.unroll(M):
                for s in T.unroll(5):
                    T.evaluate(T.ptx["shfl_sync.bfly.b32"](other[0], part[m], T.uint32(16 >> s), T.uint32(31),
                                                            T.uint32(0xFFFFFFFF)))
                    part[m] = part[m] + other[0]
                if lane == 0:
                    if use_bias:
                        Y[m, n] = T.Cast("float16", part[m] + T.Cast("float32", B[n]))
                    else:
                        Y[m, n] = T.Cast("float16", part[m])

    return tvm.IRModule({spec.name: kernel})
