"""A measuring instrument, not a sparta kernel: the fastest plain one-pass read of N bytes.

A GEMV's floor is its bytes over the copy bandwidth, but a kernel of a few µs also pays its launch and the
ramp of its first loads. This kernel reads the same bytes and does nothing else (16-byte
``ld.global.nc.L1::no_allocate`` loads, grid-stride, ``unroll`` loads in flight per thread, an xor kept
alive by a never-taken store), so its time is what any kernel streaming them can hope for. Built through
TVM with the W4A16 kernels (``benchmarks/build_w4a16_kernels.py``), timed beside them (``bench_cuda_w4a16.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ReadProbeSpec:
    words: int                  # 16-byte words to read
    ctas: int = 528             # 4 per SM of an H100/H200
    threads: int = 512
    unroll: int = 2
    name: str = "read_probe"

    def key(self) -> dict:
        return asdict(self)


def read_probe(spec: ReadProbeSpec):
    """The probe as an IRModule with one PrimFunc ``spec.name``: arguments ``P`` (words, 4) int32, ``O`` (1,)."""
    import tvm
    from tvm.script import tirx as T

    N, C, TH, U = spec.words, spec.ctas, spec.threads, spec.unroll
    ITERS = -(-N // (C * TH * U))

    @T.prim_func
    def kernel(p_h: T.handle, o_h: T.handle):
        T.func_attr({"global_symbol": spec.name, "tirx.noalias": True})
        P = T.match_buffer(p_h, (N, 4), "int32")
        O = T.match_buffer(o_h, (1,), "int32")
        bx = T.launch_thread("blockIdx.x", C)
        tx = T.launch_thread("threadIdx.x", TH)
        v = T.alloc_buffer((U * 4,), "uint32", scope="local")
        acc = T.alloc_buffer((1,), "uint32", scope="local")
        acc[0] = T.uint32(0)
        for it in T.serial(ITERS):
            for u in T.unroll(U):
                i = T.meta_var((it * U + u) * C * TH + bx * TH + tx)
                if i < N:
                    T.evaluate(T.ptx["ld.global.nc.L1::no_allocate.v4.b32"](
                        v[u * 4], v[u * 4 + 1], v[u * 4 + 2], v[u * 4 + 3], P.ptr_to([i, 0])))
                else:
                    for e in T.unroll(4):
                        v[u * 4 + e] = T.uint32(0)
            for u in T.unroll(U):
                acc[0] = acc[0] ^ v[u * 4] ^ v[u * 4 + 1] ^ v[u * 4 + 2] ^ v[u * 4 + 3]
        if acc[0] == T.uint32(0x9E3779B9):      # never true in practice: keeps the loads alive
            O[0] = T.reinterpret("int32", acc[0])

    return tvm.IRModule({spec.name: kernel})
