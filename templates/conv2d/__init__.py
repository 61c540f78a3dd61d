"""Block-sparse implicit-GEMM 2-D convolution on channels-last fp16/bf16 tensors, tensor cores (``spec.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "conv2d", ("cuda",),
    "2-D convolution as an implicit GEMM over channels-last fp16/bf16 tensors (any kernel size, stride, padding, "
    "dilation; groups=1), block-sparse over (output-channel block x (tap, input-channel block)), pruned blocks never "
    "loaded; bias, ReLU/SiLU and a residual add in the epilogue",
    module=".runtime:Conv2dCUDA",
    templates={".spec:Conv2dSpec": ".kernel:conv2d_kernel"},
    build=".build:build", epilogue=("bias", "relu")), __name__)
