"""Block-sparse (and dense) tensor-core linear for CUDA: fp16, W8A8 and W4A16 operands (see ``spec.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "bsr_linear", ("cuda",),
    "block-sparse and dense tensor-core linear: fp16/bf16, W8A8 and W4A16 (mma.sync, wgmma, streaming grid, "
    "warp-specialised, ping-pong) with its few-row GEMVs",
    module=".runtime:SparseLinearCUDA",
    templates={".spec:BsrSpec": ".kernel:bsr_linear", ".gemv_spec:BsrGemvSpec": ".gemv:bsr_gemv"},
    build=".build:build", epilogue=None), __name__)
