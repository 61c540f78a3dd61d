"""A block-sparse linear layer running sparta's CUDA ``bsr_linear`` kernel (no TVM needed).

``BsrLinearOp(folder, spec, weight, block_mask, bias)`` packs the kept blocks once
(``sparta.templates.cuda_bsr.pack_weight``) and then ``op(x)`` computes
``act(x · (W ⊙ mask)ᵀ + b)`` in fp16 on the current stream.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import torch

from ..templates.cuda_bsr import BsrSpec, block_mask_of, pack_weight
from .cuda import CudaKernel, CudaRuntimeError


def spec_from_json(d: dict) -> BsrSpec:
    return BsrSpec(**{**d, "pattern": tuple(tuple(p) for p in d.get("pattern", ()))})


def load_spec(folder) -> BsrSpec:
    """The spec a kernel folder was built from (``spec.json`` beside ``launch.json``)."""
    return spec_from_json(json.loads((Path(folder) / "spec.json").read_text()))


class BsrLinearOp:
    """One sparse linear: packed weights + table on the GPU, the kernel loaded from ``folder``."""

    def __init__(self, folder, spec: BsrSpec, weight: torch.Tensor, block_mask: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        self.kernel, self.spec = CudaKernel(folder), spec
        if tuple(weight.shape) != (spec.n, spec.k):
            raise CudaRuntimeError(f"{spec.name}: weight is {tuple(weight.shape)}, the kernel wants {(spec.n, spec.k)}")
        if block_mask is None:
            block_mask = block_mask_of(weight, spec.bn, spec.bk)
        block_mask = block_mask.bool().cpu()
        if spec.table == "const":
            if not torch.equal(spec.pattern_mask(), block_mask):
                raise CudaRuntimeError(f"{spec.name}: the block mask differs from the pattern baked into the kernel")
        if spec.bias and bias is None:
            raise CudaRuntimeError(f"{spec.name}: the kernel adds a bias; pass one")
        dev = weight.device
        self.wp, self.table = pack_weight(weight.half(), spec, block_mask)
        self.bias = bias.half().contiguous().to(dev) if bias is not None else torch.zeros(spec.n, dtype=torch.float16, device=dev)
        self._prepared = None
        self.density = float(block_mask.float().mean()) if block_mask.numel() else 0.0

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        if x.shape != (s.m, s.k) or x.dtype != torch.float16 or not x.is_contiguous():
            raise CudaRuntimeError(f"{s.name}: input must be a contiguous fp16 ({s.m}, {s.k}) tensor, "
                                   f"got {x.dtype} {tuple(x.shape)}")
        y = torch.empty(s.m, s.n, dtype=torch.float16, device=x.device) if out is None else out
        if self._prepared is None:
            self._prepared = self.kernel.prepare(X=x, Wp=self.wp.view(-1), B=self.bias, Tab=self.table, Y=y)
        else:
            self._prepared.launch(X=x, Y=y)
        return y


__all__ = ["BsrLinearOp", "load_spec", "spec_from_json"]
