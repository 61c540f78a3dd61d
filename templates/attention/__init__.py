"""Attention over sizes-only masks: torch SDPA with the mask classified once per shape (see ``runtime.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "attention", ("cuda", "cpu"),
    "attention whose mask is computed from sizes alone: torch SDPA, the mask classified once per shape",
    module=".runtime:SizesOnlyMaskAttention",
    templates={},
    build=".build:build", epilogue=None), __name__)
