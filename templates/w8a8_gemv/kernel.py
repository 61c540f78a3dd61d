"""The W8A8 GEMV template: the kernel a ``W8A8GemvSpec`` names (tensor cores for ``mma``, else dp4a)."""

from __future__ import annotations

from .dp4a import w8a8_gemv_dp4a
from .mma import w8a8_gemv_mma
from .spec import W8A8GemvSpec


def w8a8_gemv(spec: W8A8GemvSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name`` (the tensor-core one for ``spec.mma``)."""
    return w8a8_gemv_mma(spec) if spec.mma else w8a8_gemv_dp4a(spec)
