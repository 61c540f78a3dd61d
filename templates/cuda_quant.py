"""Per-row (per-token) symmetric int8 quantisation of fp16 activations for the W8A8 kernels, in TVMScript.

``XQ[m, :] = clamp(round(X[m, :] / s[m]), ±127)``, ``s[m] = max|X[m, :]| · (1/127)`` — bit for bit what
``sparta.templates.cuda_bsr_ref.quantize_rows`` computes in torch (fp32 division, round half to even).
``threads=32``: a warp per row, four rows per CTA; more: a CTA per row. Every 16-byte load of a thread
is in flight before the first use, the row maximum is a butterfly of warp shuffles (plus one shared-memory
step across warps), each quotient is x times the row's reciprocal corrected by one ``fma`` (correctly
rounded like torch's division, 3 instructions), 8-byte int8 stores. Memory-bound: it reads 2 and writes 1
byte per element. (The first version, a CTA of 128 threads per row with a shared-memory tree reduction and
IEEE division, ran at half the copy bandwidth: 25 µs for 4096×3072 on an H100, BERT-base's FFN2 input.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class QuantRowsSpec:
    m: int
    k: int                      # a multiple of 8 (16-byte rows)
    threads: int = 32           # threads per row: 32 = a warp per row (4 rows per CTA), 64..512 = a CTA per row
    name: str = "quantize_rows"

    def __post_init__(self):
        if self.m <= 0 or self.k <= 0 or self.k % 8:
            raise ValueError(f"spec {self.name}: M and K must be positive and K={self.k} a multiple of 8")
        if self.threads not in (32, 64, 128, 256, 512):
            raise ValueError(f"spec {self.name}: threads must be a power of two from 32 to 512")
        if -(-self.k // 8 // self.threads) > 32:
            raise ValueError(f"spec {self.name}: K={self.k} needs more than 32 chunks per thread; use more threads")

    @property
    def rows_per_cta(self) -> int:
        return 4 if self.threads == 32 else 1

    def key(self) -> dict:
        return asdict(self)


def quotient(x, d, r):
    """TIR: ``x / d`` correctly rounded, from ``r`` = RN(1/d) (Markstein: q = RN(x·r) is within an ulp; one
    ``fma`` with the exact remainder x - q·d corrects it) — 3 instructions instead of IEEE division's
    subroutine, bit for bit torch's fp32 division where the quotient neither overflows nor underflows."""
    from tvm.script import tirx as T
    q = T.call_pure_extern("float32", "__fmul_rn", x, r)
    rem = T.call_pure_extern("float32", "__fmaf_rn", q, T.float32(0) - d, x)
    return T.call_pure_extern("float32", "__fmaf_rn", rem, r, q)


def int8_scale(absmax):
    """TIR: the per-token scale of a row whose ``max |x|`` is ``absmax`` (``quantize_rows``: max·(1/127))."""
    from tvm.script import tirx as T
    return T.max(absmax, T.float32(1e-12)) * T.float32(1.0 / 127.0)


def int8_code(q):
    """TIR: the int8 code of the fp32 quotient ``q`` = x / scale: rounded half to even, clamped to ±127."""
    from tvm.script import tirx as T
    return T.Cast("int8", T.max(T.min(T.nearbyint(q), T.float32(127)), T.float32(-127)))


def store_codes(chunks: int, threads: int):
    """TIR macro ``store_codes(sc, absmax, src, codes, XS, XQ, row, t)`` for a row of ``chunks`` 16-byte chunks over
    ``threads`` threads: the per-token scale of the row's ``absmax`` into ``sc[0]`` (its reciprocal into ``sc[1]``),
    written to ``XS[row]`` by thread 0, and the int8 codes of thread ``t``'s chunks of values (chunk ``it`` at
    ``src[it * 8]``) into ``XQ[row]``, 8 bytes per store. Shared by the quantiser and the LayerNorm kernel."""
    from tvm.script import tirx as T
    IT, full = -(-chunks // threads), chunks % threads == 0

    @T.macro
    def store(sc, absmax, src, codes, XS, XQ, row, t):
        sc[0] = int8_scale(absmax)
        sc[1] = T.float32(1) / sc[0]
        if t == 0:
            XS[row] = sc[0]
        for it in T.unroll(IT):
            if full or t + it * threads < chunks:
                for v in T.unroll(8):
                    codes[v] = int8_code(quotient(T.Cast("float32", src[it * 8 + v]), sc[0], sc[1]))
                for v in T.vectorized(8):
                    XQ[row, (t + it * threads) * 8 + v] = codes[v]
    return store


def row_max(warps: int):
    """TIR macro ``row_max(mx, red, lane, t)``: every thread of a row of ``warps`` warps ends with the row's
    maximum of ``mx[0]`` (``mx[1]`` is scratch): a butterfly of warp shuffles, then, across warps, one step
    through the shared ``red[warps]``. Shared by the quantiser and the LayerNorm kernel's |y| maximum."""
    from tvm.script import tirx as T
    FULL = T.uint32(0xFFFFFFFF)

    @T.macro
    def reduce(mx, red, lane, t):
        for s in T.unroll(5):
            T.evaluate(T.ptx["shfl_sync.bfly.b32"](mx[1], mx[0], T.uint32(16 >> s), T.uint32(31), FULL))
            mx[0] = T.max(mx[0], mx[1])
        if warps > 1:
            if lane == 0:
                red[t // 32] = mx[0]
            T.tvm_storage_sync("shared")
            for w in T.unroll(warps):
                mx[0] = T.max(mx[0], red[w])
    return reduce


def pick_threads(k: int) -> int:
    """A warp per row up to 16 chunks (4096 columns) per lane, else a CTA per row with at most 16 per thread."""
    chunks, threads = -(-k // 8), 32
    while threads < 512 and -(-chunks // threads) > 16:
        threads *= 2
    return threads


def argument_names(spec: QuantRowsSpec) -> list[str]:
    return ["X", "XQ", "XS"]


def quantize_rows_kernel(spec: QuantRowsSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``."""
    import tvm
    from tvm.script import tirx as T

    M, K, NT = spec.m, spec.k, spec.threads
    R = spec.rows_per_cta
    CH = K // 8                                   # 16-byte chunks per row
    IT = -(-CH // NT)
    WARPS = NT // 32
    full = CH % NT == 0
    reduce_max = row_max(WARPS)
    emit_codes = store_codes(CH, NT)

    @T.prim_func
    def kernel(x_h: T.handle, xq_h: T.handle, xs_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        X = T.match_buffer(x_h, (M, K), "float16")
        XQ = T.match_buffer(xq_h, (M, K), "int8")
        XS = T.match_buffer(xs_h, (M,), "float32")
        bx = T.launch_thread("blockIdx.x", -(-M // R))
        tx = T.launch_thread("threadIdx.x", NT * R)
        red = T.alloc_buffer((WARPS,), "float32", scope="shared")
        raw = T.alloc_buffer((IT * 8,), "float16", scope="local")
        mx = T.alloc_buffer((2,), "float32", scope="local")        # |x| max, a partner's; then scale, 1 / scale
        codes = T.alloc_buffer((8,), "int8", scope="local")
        row = T.meta_var(bx * R + tx // NT)
        t = T.meta_var(tx % NT)
        lane = T.meta_var(tx % 32)
        if R == 1 or M % R == 0 or row < M:     # a warp per row: the guard is warp-uniform
            for it in T.unroll(IT):            # every load in flight before the first use
                if full or t + it * NT < CH:
                    for v in T.vectorized(8):
                        raw[it * 8 + v] = X[row, (t + it * NT) * 8 + v]
            mx[0] = T.float32(0)
            for it in T.unroll(IT):
                if full or t + it * NT < CH:
                    for v in T.unroll(8):
                        mx[0] = T.max(mx[0], T.fabs(T.Cast("float32", raw[it * 8 + v])))
            reduce_max(mx, red, lane, t)
            emit_codes(mx, mx[0], raw, codes, XS, XQ, row, t)

    return tvm.IRModule({spec.name: kernel})
