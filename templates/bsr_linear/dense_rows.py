"""Calls of many rows on the vendor dense GEMM (``KernelChoice.dense_from``): where the plan prices a block-sparse
op's kernels above dense cuBLAS from some number of rows on (a 50% mask: the GEMV reads half the bytes at decode,
the tiles lose to cuBLAS at prefill), the op runs ``torch.nn.functional.linear`` over a dense copy of its kept
weight there, then the epilogue its kernels fuse (activation; gated unit) in torch. The copy is unpacked from the
packed blocks on their device at the first such call (outside any CUDA graph capture), so saved folders and
checkpoints carry the packed blocks only.
"""

from __future__ import annotations

import torch

from ..epilogue_ref import activate, gated
from ...runtime.cuda import CudaRuntimeError


class DenseRows:
    """Mixin of a 16-bit kernel module (:class:`~.runtime.SparseLinearCUDA`, the 2:4 ``NmLinearCUDA``):
    ``dense_from`` and the dense copy (a buffer, not saved). The module gives :meth:`packed_source` (the packed
    tensor a copy is made from: a new one makes a new copy) and :meth:`unpacked` (the dense (N, K) weight, gated:
    (2N, K), on that tensor's device); its ``spec`` has ``dtype``, ``act``, ``bias`` and maybe ``gate`` / ``out``."""

    def init_dense_rows(self, dense_from: int | None) -> None:
        if dense_from is not None and (self.spec.dtype not in ("float16", "bfloat16")
                                       or getattr(self.spec, "out", "") == "int8"):
            raise CudaRuntimeError(f"op {self.op_name!r}: only a 16-bit kernel writing 16-bit outputs runs its many-row "
                                   f"calls on the dense GEMM (dtype {self.spec.dtype})")
        self.dense_from = None if dense_from is None else int(dense_from)
        self.register_buffer("dense_w", None, persistent=False)
        self._dense_of = None

    def dense_rows_call(self, x: torch.Tensor) -> torch.Tensor | None:
        """The op's output for ``x`` on the dense GEMM if its rows reach ``dense_from`` (else None)."""
        if self.dense_from is None or x.shape[0] < self.dense_from:
            return None
        w = self._dense_weight()
        y = torch.nn.functional.linear(x, w, self.bias if self.spec.bias else None)
        if getattr(self.spec, "gate", False):          # in the input's dtype, as the model's own MLP computes it
            return gated(y, self.spec.act)
        return y if self.spec.act == "none" else activate(y, self.spec.act)

    def _dense_weight(self) -> torch.Tensor:
        source = self.packed_source()
        key = (source.data_ptr(), source.device)
        if self.dense_w is None or self._dense_of != key:
            if source.is_cuda and torch.cuda.is_current_stream_capturing():
                raise CudaRuntimeError(f"op {self.op_name!r}: its dense copy is built at the first call of "
                                       f"{self.dense_from}+ rows; run such a call once before capturing a CUDA graph")
            self.dense_w = self.unpacked()
            self._dense_of = key
        return self.dense_w

    def dense_rows_repr(self) -> str:
        return f", cuBLAS on a dense copy from {self.dense_from} rows" if self.dense_from is not None else ""


__all__ = ["DenseRows"]
