"""FP8 (E4M3) weight GEMV for decode (1..16 rows), dense or 32×32 block-sparse (``spec.py``)."""

from ..epilogue_ref import ACTIVATIONS
from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "fp8_gemv", ("cuda",),
    "FP8 (E4M3) weight linear for 1-16 rows, dense or 32x32 block-sparse: codes decoded by cvt.rn.f16x2.e4m3x2, fp32 "
    "accumulation, per-channel or 128x128 block scales, split K optional, bias and activation fused",
    module=".runtime:Fp8LinearCUDA",
    templates={".spec:Fp8GemvSpec": ".kernel:fp8_gemv", ".dequant:Fp8DequantSpec": ".dequant:fp8_dequant"},
    build=".graph_build:build", epilogue=("bias", *ACTIVATIONS[1:])), __name__)
