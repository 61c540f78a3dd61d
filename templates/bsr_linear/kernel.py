"""The ``bsr_linear`` template: the kernel variant a ``BsrSpec`` names, as an IRModule (what ``build_cuda`` takes)."""

from __future__ import annotations

from .mma import bsr_linear_mma
from .spec import BsrSpec
from .stream import bsr_linear_stream
from .warp_specialized import bsr_linear_warp_specialized
from .wgmma import bsr_linear_wgmma


def bsr_linear(spec: BsrSpec):
    """The kernel as an IRModule with one PrimFunc named ``spec.name``: the warp-specialised Hopper kernel for
    ``spec.producer``, the ``wgmma`` one for ``spec.mma == "wgmma"``, the streaming one for ``spec.groups``, else the
    one-tile ``mma.sync`` kernel."""
    if spec.producer:
        return bsr_linear_warp_specialized(spec)
    if spec.mma == "wgmma":
        return bsr_linear_wgmma(spec)
    if spec.groups:
        return bsr_linear_stream(spec)
    return bsr_linear_mma(spec)
