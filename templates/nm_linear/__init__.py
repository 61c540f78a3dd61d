"""2:4 semi-structured sparse linear for decode and small batches on the sparse tensor cores (``mma.sp`` m16n8k32):
half the values and 2-bit indices, pre-swizzled into the MMA's fragments (``spec.py``)."""

from ..epilogue_ref import ACTIVATIONS
from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "nm_linear", ("cuda",),
    "2:4 sparse linear for 1-64 rows on mma.sp m16n8k32: the compressed values and metadata streamed into the "
    "sparse A fragments, X^T as B (split K optional), bias and activation fused",
    module=".runtime:NmLinearCUDA",
    templates={".spec:NmLinearSpec": ".kernel:nm_linear"},
    build=".graph_build:build", epilogue=("bias", *ACTIVATIONS[1:])), __name__)
