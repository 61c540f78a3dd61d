"""Per-row (per-token) symmetric int8 quantisation of fp16 activations for the W8A8 kernels, in TVMScript.

``XQ[m, :] = clamp(round(X[m, :] / s[m]), ±127)``, ``s[m] = max|X[m, :]| · (1/127)`` — bit for bit what
``sparta.templates.cuda_bsr_ref.quantize_rows`` computes in torch (fp32 division, round half to even).
One CTA per row: 16-byte loads, a shared-memory max reduction, 8-byte int8 stores. Memory-bound:
it reads 2 and writes 1 byte per element.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class QuantRowsSpec:
    m: int
    k: int                      # a multiple of 8 (16-byte rows)
    threads: int = 128
    name: str = "quantize_rows"

    def __post_init__(self):
        if self.m <= 0 or self.k <= 0 or self.k % 8:
            raise ValueError(f"spec {self.name}: M and K must be positive and K={self.k} a multiple of 8")
        if self.threads not in (32, 64, 128, 256, 512):
            raise ValueError(f"spec {self.name}: threads must be a power of two from 32 to 512")

    def key(self) -> dict:
        return asdict(self)


def argument_names(spec: QuantRowsSpec) -> list[str]:
    return ["X", "XQ", "XS"]


def quantize_rows_kernel(spec: QuantRowsSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    M, K, NT = spec.m, spec.k, spec.threads
    CH = K // 8                                   # 16-byte chunks per row
    ITERS = -(-CH // NT)

    @T.prim_func
    def kernel(x_h: T.handle, xq_h: T.handle, xs_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        X = T.match_buffer(x_h, (M, K), "float16")
        XQ = T.match_buffer(xq_h, (M, K), "int8")
        XS = T.match_buffer(xs_h, (M,), "float32")
        row = T.launch_thread("blockIdx.x", M)
        tx = T.launch_thread("threadIdx.x", NT)
        red = T.alloc_buffer((NT,), "float32", scope="shared")
        vals = T.alloc_buffer((ITERS * 8,), "float16", scope="local")
        amax = T.alloc_buffer((1,), "float32", scope="local")
        scale = T.alloc_buffer((1,), "float32", scope="local")
        codes = T.alloc_buffer((8,), "int8", scope="local")
        amax[0] = T.float32(0)
        for it in T.unroll(ITERS):
            c = T.meta_var(tx + it * NT)
            if CH % NT == 0 or c < CH:
                for v in T.vectorized(8):
                    vals[it * 8 + v] = X[row, c * 8 + v]
                for v in T.unroll(8):
                    amax[0] = T.max(amax[0], T.fabs(T.Cast("float32", vals[it * 8 + v])))
        red[tx] = amax[0]
        T.tvm_storage_sync("shared")
        for step in T.unroll(NT.bit_length() - 1):  # tree reduction: NT/2, NT/4, ..., 1
            half = T.meta_var(NT >> (step + 1))
            if tx < half:
                red[tx] = T.max(red[tx], red[tx + half])
            T.tvm_storage_sync("shared")
        scale[0] = T.max(red[0], T.float32(1e-12)) * T.float32(1.0 / 127.0)
        if tx == 0:
            XS[row] = scale[0]
        for it in T.unroll(ITERS):
            c = T.meta_var(tx + it * NT)
            if CH % NT == 0 or c < CH:
                for v in T.unroll(8):
                    codes[v] = T.Cast("int8", T.max(T.min(T.nearbyint(T.Cast("float32", vals[it * 8 + v]) / scale[0]),
                                                          T.float32(127)), T.float32(-127)))
                for v in T.vectorized(8):
                    XQ[row, c * 8 + v] = codes[v]

    return tvm.IRModule({spec.name: kernel})
