"""A fine-grained (unstructured) sparse linear running sparta's CUDA ``fine_linear`` kernel (no TVM needed).

``FineLinearOp(folder, spec, weight, keep, bias)`` packs the kept elements once as CSR
(``sparta.templates.cuda_fine.pack_weight``); ``op(x)`` computes ``act(x · (W ⊙ keep)ᵀ + b)`` in fp16.
"""

from __future__ import annotations

import torch

from ..templates.cuda_fine import FineSpec, pack_weight
from .cuda import CudaKernel, CudaRuntimeError, check_fp16_input


class FineLinearOp:
    def __init__(self, folder, spec: FineSpec, weight: torch.Tensor, keep: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        if tuple(weight.shape) != (spec.n, spec.k):
            raise CudaRuntimeError(f"{spec.name}: weight is {tuple(weight.shape)}, the kernel wants {(spec.n, spec.k)}")
        if spec.bias and bias is None:
            raise CudaRuntimeError(f"{spec.name}: the kernel adds a bias; pass one")
        self.kernel, self.spec = CudaKernel(folder), spec
        self.row_ptr, self.cols, self.vals = pack_weight(weight, keep)
        dev = weight.device
        self.bias = bias.half().contiguous().to(dev) if bias is not None else torch.zeros(spec.n, dtype=torch.float16,
                                                                                          device=dev)
        self.density = int(self.row_ptr[-1]) / (spec.n * spec.k)
        self._prepared = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        check_fp16_input(s.name, x, s.m, s.k)
        y = torch.empty(s.m, s.n, dtype=torch.float16, device=x.device) if out is None else out
        if self._prepared is None:
            self._prepared = self.kernel.prepare(X=x, RowPtr=self.row_ptr, Cols=self.cols, Vals=self.vals,
                                                 B=self.bias, Y=y)
        else:
            self._prepared.launch(X=x, Y=y)
        return y


__all__ = ["FineLinearOp"]
