"""CPU linears through LLVM: block-sparse (``block_spec.py``, ``block.py``) and fine-grained (``fine_spec.py``,
``fine.py``), fp32, W8A8 and W4A32."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "cpu_linear", ("cpu",),
    "block-sparse and fine-grained CPU linears through LLVM: fp32, W8A8, W8A32 and W4A32",
    module=".runtime:SparseLinearCPU",
    templates={},
    build=".build:build", epilogue=None), __name__)
