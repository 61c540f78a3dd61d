"""Dense W8A8 linear on the CPU through oneDNN's int8 GEMM (see ``runtime.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "onednn_int8", ("cpu",),
    "dense W8A8 linear on the CPU through oneDNN's int8 GEMM",
    module=".runtime:Int8LinearCPU",
    templates={},
    build=".build:build", epilogue=("bias",)), __name__)
