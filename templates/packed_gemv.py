"""What the few-row GEMV families' kernel modules share (``bitmap_gemv``, ``fp8_gemv``, ``nm_linear``): a module over
one packed weight whose op takes ``[x (M, K)]``; ``forward`` flattens the leading dimensions into M and back,
``launch`` makes the family's launcher again whenever the packed buffers moved (``.to``, a repack), with the split-K
workspace buffers (``split_P``, ``split_Cnt``) where ``spec.ksplit > 1``, and ``fake`` gives the output's shape."""

from __future__ import annotations

import torch

from ..runtime.cuda import CudaRuntimeError


class PackedGemvModule:
    """Mixin before ``KernelModule``. The module has ``spec`` (``n``, ``k``, ``dtype``, ``ksplit``), ``folder``,
    ``op_name``, ``bias``, ``packed`` and sets ``op_class`` (its launcher: ``op_class(folder, spec, packed, bias,
    split)``) and ``packed_names`` (the buffers a launcher reads); ``_op`` starts None."""

    op_class = None
    packed_names: tuple[str, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = getattr(torch, self.spec.dtype)
        (y,) = self.call_kernel(x.reshape(-1, self.spec.k).to(dtype).contiguous())
        return y.reshape(*x.shape[:-1], self.spec.n).to(x.dtype)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        x = inputs[0]
        buffers = [getattr(self, n) for n in self.packed_names]
        if not x.is_cuda or not buffers[0].is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r} was compiled for CUDA; move the module and inputs to a GPU "
                                   "(module.to('cuda'))")
        key = tuple(b.data_ptr() for b in buffers)
        if self._op is None or getattr(self, "_op_key", None) != key:
            split = {"P": self.split_P, "Cnt": self.split_Cnt} if self.spec.ksplit > 1 else {}
            self._op, self._op_key = self.op_class(self.folder, self.spec, self.packed, self.bias, split), key
        return [self._op(x)]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        x = inputs[0]
        return [x.new_empty((x.shape[0], self.spec.n), dtype=getattr(torch, self.spec.dtype))]


__all__ = ["PackedGemvModule"]
