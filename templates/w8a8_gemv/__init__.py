"""W8A8 GEMV for decode (1..16 rows): int8 weights per channel, int8 activations per token (see ``spec.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "w8a8_gemv", ("cuda",),
    "W8A8 GEMV for decode (1..16 rows): int8 weights per channel, int8 activations per token",
    module=".runtime:W8A8GemvCUDA",
    templates={".spec:W8A8GemvSpec": ".kernel:w8a8_gemv"},
    build=".build:build", epilogue=None), __name__)
