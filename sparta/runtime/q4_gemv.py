"""W4A8 quantized GEMV running sparta's dp4a kernels (``templates/cuda_q4_gemv.py``), no TVM needed.

``Q4GemvOp(gemv_folder, quant_folder, wq, dw, bias)`` holds q4 weights packed by
``cuda_q4_gemv.quantize_weight``; ``op(x)`` quantises the fp16 activation rows per 32-element block
(the ``quantize_q8`` kernel) and multiplies them with the weights (the ``q4_gemv`` kernel), both on
torch's current stream.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..templates.cuda_q4_gemv import BLOCK, Q4GemvSpec, Q8QuantSpec
from .cuda import CudaKernel, CudaRuntimeError, check_fp16_input


class Q4GemvOp:
    """``y = q8(x) · q4(W)ᵀ (+ b)`` for ``x`` of the spec's ``(M, K)``, fp16 in and out."""

    def __init__(self, gemv_folder, quant_folder, wq: torch.Tensor, dw: torch.Tensor,
                 bias: torch.Tensor | None = None):
        self.gemv, self.quant = CudaKernel(gemv_folder), CudaKernel(quant_folder)
        self.spec = Q4GemvSpec(**json.loads((Path(gemv_folder) / "spec.json").read_text()))
        qspec = Q8QuantSpec(**json.loads((Path(quant_folder) / "spec.json").read_text()))
        s = self.spec
        if (qspec.m, qspec.k) != (s.m, s.k):
            raise CudaRuntimeError(f"{s.name}: quantiser {qspec.name} is for {(qspec.m, qspec.k)}, not {(s.m, s.k)}")
        if wq.shape != (s.n, s.k // 8) or wq.dtype != torch.int32 or dw.shape != (s.n, s.k // BLOCK):
            raise CudaRuntimeError(f"{s.name}: weights must be int32 ({s.n}, {s.k // 8}) codes and "
                                   f"({s.n}, {s.k // BLOCK}) scales from quantize_weight")
        if s.bias and bias is None:
            raise CudaRuntimeError(f"{s.name}: the kernel adds a bias; pass one")
        dev = wq.device
        self.wq, self.dw = wq.contiguous(), dw.half().contiguous().to(dev)
        self.bias = bias.half().contiguous().to(dev) if s.bias else None
        self.xq = torch.empty(s.m, s.k, dtype=torch.int8, device=dev)
        self.xd = torch.empty(s.m, s.k // BLOCK, 2, dtype=torch.float32, device=dev)
        self._quant, self._gemv = None, None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        check_fp16_input(s.name, x, s.m, s.k)
        y = torch.empty(s.m, s.n, dtype=torch.float16, device=x.device) if out is None else out
        if self._quant is None:
            self._quant = self.quant.prepare(X=x, XQ=self.xq, XD=self.xd)
            args = dict(XQ=self.xq.view(torch.int32), XD=self.xd, Wq=self.wq, Dw=self.dw, Y=y)
            self._gemv = self.gemv.prepare(**args, **({"B": self.bias} if s.bias else {}))
        else:
            self._quant.launch(X=x)
            self._gemv.launch(Y=y)
        return y

    def gemv_only(self, out: torch.Tensor) -> None:
        """The GEMV on the activations quantised by the last call (for timing the two kernels apart)."""
        self._gemv.launch(Y=out)


__all__ = ["Q4GemvOp"]
