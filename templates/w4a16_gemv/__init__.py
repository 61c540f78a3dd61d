"""W4A16 GEMV for decode (1..16 rows): int4 weights dequantised by lop3 into mma.sync (see ``spec.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "w4a16_gemv", ("cuda",),
    "W4A16 GEMV for decode (1..16 rows): int4 weights dequantised by lop3 into mma.sync",
    module=".runtime:W4A16GemvCUDA",
    templates={".spec:W4A16Spec": ".kernel:w4a16_gemv", ".dequant:W4DequantSpec": ".dequant:w4a16_dequant"},
    build=".build:build", epilogue=("bias",)), __name__)
