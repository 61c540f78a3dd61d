"""Unstructured sparse GEMV for few rows (decode): fp16/bf16 kept values and a 1-bit bitmap (``spec.py``)."""

from ..epilogue_ref import ACTIVATIONS
from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "bitmap_gemv", ("cuda",),
    "unstructured sparse linear for 1-16 rows: the kept fp16/bf16 values and a 1-bit bitmap, each lane walking its "
    "set bits against X staged in shared memory (split K optional), bias and activation fused",
    module=".runtime:BitmapLinearCUDA",
    templates={".spec:BitmapGemvSpec": ".kernel:bitmap_gemv"},
    build=".build:build_bitmap_gemv", epilogue=("bias", *ACTIVATIONS[1:])), __name__)
