"""CUDA tensor-core GEMM ``Y = X · Wᵀ`` (fp16 inputs, fp32 accumulate and output) as a TVM schedule.

``X`` is ``(M, K)``, ``W`` is ``(N, K)`` (a linear layer's weight, used transposed), ``Y`` is
``(M, N)`` fp32. The schedule tiles the output into ``TM × TN`` CTA tiles of four warps;
each ``TK`` slice of ``K`` is staged through padded shared memory, loaded into
fragments with ``ldmatrix`` and multiplied with ``mma.sync.m16n8k16`` (TVM's tensor
intrinsics). This is the dense template every block-sparse variant is measured against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

TM, TN, TK = 64, 64, 32     # CTA tile; 4 warps of 32x32, K staged 32 at a time


@dataclass(frozen=True)
class GemmSpec:
    m: int
    n: int
    k: int
    name: str = "gemm_f16"

    def __post_init__(self):
        if self.m % TM or self.n % TN or self.k % TK:
            raise ValueError(f"spec {self.name}: M={self.m}, N={self.n}, K={self.k} must be multiples of "
                             f"{TM}, {TN}, {TK} (pad the operands)")

    def key(self) -> dict:
        return asdict(self)


def argument_names(spec: GemmSpec) -> list[str]:
    return ["X", "W", "Y"]


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel computes: fp16 products accumulated in fp32."""
    return x.float() @ w.float().t()


def mma_gemm(spec: GemmSpec):
    """The scheduled IRModule (one PrimFunc named ``spec.name``)."""
    import tvm
    from tvm import s_tir, te
    from tvm.s_tir.tensor_intrin.cuda import get_mma_intrin_group, shared_16x16_to_ldmatrix_32x8_layout

    m, n, k = spec.m, spec.n, spec.k
    x = te.placeholder((m, k), "float16", name="X")
    w = te.placeholder((n, k), "float16", name="W")
    r = te.reduce_axis((0, k), name="k")
    y = te.compute((m, n), lambda i, j: te.sum(x[i, r].astype("float32") * w[j, r].astype("float32"), axis=r),
                   name="Y")
    func = te.create_prim_func([x, w, y]).with_attr("global_symbol", spec.name)
    sch = s_tir.Schedule(tvm.IRModule({spec.name: func}))
    g = get_mma_intrin_group("shared", "global", "float16", "float32", False, True, not_use_mma_store_intrinic=False)
    blk = sch.get_sblock("Y", func_name=spec.name)
    i, j, kk = sch.get_loops(blk)
    i, i_tc = sch.split(i, [None, 16])
    j, j_tc = sch.split(j, [None, 16])
    kk, k_tc = sch.split(kk, [None, 16])
    sch.reorder(i, j, kk, i_tc, j_tc, k_tc)
    outer = sch.blockize(i_tc)
    # i (units of 16): CTA rows | warp rows (2) | fragments per warp (2); j likewise
    i0, i1, i2 = sch.split(i, [None, 2, 2])
    j0, j1, j2 = sch.split(j, [None, 2, 2])
    k0, k1 = sch.split(kk, [None, TK // 16])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(sch.fuse(i0, j0), "blockIdx.x")
    ty = sch.fuse(i1, j1)
    sch.bind(ty, "threadIdx.y")
    for idx in (0, 1):
        sh = sch.cache_read(outer, idx, "shared")
        sch.compute_at(sh, k0)
        _, yy, xx, v = sch.split(sch.fuse(*sch.get_loops(sh)[-2:]), [None, 4, 32, 8])
        sch.bind(yy, "threadIdx.y")
        sch.bind(xx, "threadIdx.x")
        sch.vectorize(v)
        sch.storage_align(sh, 0, axis=-2, factor=32, offset=8)    # padded rows: no bank conflicts
    a_w = sch.cache_read(outer, 0, "warp")
    sch.compute_at(a_w, k1)
    b_w = sch.cache_read(outer, 1, "warp")
    sch.compute_at(b_w, k1)
    c_w = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(c_w, ty)
    sch.decompose_reduction(outer, sch.get_loops(outer)[2])   # above k0

    def tile16(b):
        lx, ly = sch.get_loops(b)[-2:]
        x0, x1 = sch.split(lx, [None, 16])
        y0, y1 = sch.split(ly, [None, 16])
        sch.reorder(x0, y0, x1, y1)
        return x1

    la, lb, lc = tile16(a_w), tile16(b_w), tile16(c_w)

    def imap(a, b):
        return (a // 16, b // 16, *shared_16x16_to_ldmatrix_32x8_layout(a % 16, b % 16))

    sch.transform_layout(a_w, ("write", 0), imap)
    sch.transform_layout(b_w, ("write", 0), imap)
    sch.transform_layout(c_w, ("read", 0), imap)
    sch.tensorize(la, g["load_a"])
    sch.tensorize(lb, g["load_b"])
    sch.tensorize(sch.get_loops(blk)[-3], g["compute"])
    sch.tensorize(sch.get_loops(sch.get_sblock("Y_init", func_name=spec.name))[-2], g["init"])
    sch.tensorize(lc, g["store"])
    return sch.mod
