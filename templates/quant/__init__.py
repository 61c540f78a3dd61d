"""Per-token int8 quantisation of fp16 activations for the W8A8 kernels (see ``spec.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "quant", ("cuda",),
    "per-token int8 quantiser of 16-bit activations, run inside the W8A8 families' modules",
    module="",
    templates={".spec:QuantRowsSpec": ".kernel:quantize_rows_kernel"},
    build="", epilogue=None), __name__)
