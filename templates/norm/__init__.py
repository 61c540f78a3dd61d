"""LayerNorm (Welford) and RMSNorm in fp16/bf16, the residual add and the per-token int8 codes fused (``spec.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "norm", ("cuda",),
    "LayerNorm (Welford) and RMSNorm in fp16/bf16, optionally adding the residual (and writing the sum) and writing "
    "per-token int8 codes",
    module=".runtime:LayerNormCUDA",
    templates={".spec:LayerNormSpec": ".kernel:layer_norm_kernel"},
    build=".build:build", epilogue=None), __name__)
