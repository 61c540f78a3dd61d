"""sparta's FP8 GEMV (``templates/fp8_gemv/``) from torch, without TVM.

:class:`Fp8GemvOp` runs the kernel on device tensors; :class:`Fp8LinearCUDA` is the kernel module (a linear of the
packed E4M3 weight for up to ``spec.rows`` rows, any leading dimensions): its op ``sparta::fp8_gemv`` (defined for
every family in ``sparta/runtime/ops.py``) takes ``[x (M, K)]`` and the packed tensors and has a fake
implementation, so it runs inside ``torch.compile`` graphs and CUDA graph captures. A ``ksplit > 1`` kernel's
workspace is a module buffer: one call at a time per module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .spec import (DTYPES, Fp8GemvError, Fp8GemvSpec, Fp8Packed, check_packed, dequantize, pack_codes, pack_weight,
                   split_buffers)
from ...runtime.cuda import check_saved_spec, kernel_file
from ...runtime.ops import KernelModule
from ..packed_gemv import PackedGemvModule, PackedGemvOp


def folder_spec(folder) -> Fp8GemvSpec:
    """The spec a kernel folder was built from (its ``spec.json``)."""
    return Fp8GemvSpec(**json.loads(kernel_file(folder, "spec.json")))


class Fp8GemvOp(PackedGemvOp):
    """The FP8 GEMV on device tensors (:class:`~..packed_gemv.PackedGemvOp`)."""

    label, error = "FP8 GEMV", Fp8GemvError
    check, split_buffers = staticmethod(check_packed), staticmethod(split_buffers)

    def weights(self) -> dict:
        p = self.packed
        return dict(Wp=p.codes, S=p.scales, **({"Tab": p.table} if self.spec.sparse else {}))


class Fp8LinearCUDA(PackedGemvModule, KernelModule):
    """``y = act(x · (s ⊙ W8)ᵀ + b)`` on the FP8 GEMV (the op ``sparta::fp8_gemv``) for ``x`` (..., K) with at most
    ``spec.rows`` rows in all; ``y`` in ``x``'s dtype."""

    kernel_family = "fp8_gemv"
    op_class, packed_names = Fp8GemvOp, ("codes", "scales")
    weight_names = ("codes", "scales", "table", "bias")

    def __init__(self, folder, spec: Fp8GemvSpec, packed: Fp8Packed, bias: torch.Tensor | None = None,
                 op_name: str = "fp8_gemv"):
        super().__init__()
        bias = bias.detach().to(DTYPES[spec.dtype]).contiguous() if bias is not None else None
        check_packed(spec, packed, bias)
        self.folder, self.spec, self.op_name = str(folder), spec, op_name
        self.register_buffer("codes", packed.codes)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("table", packed.table)
        self.register_buffer("bias", bias)
        for key, buf in split_buffers(spec, packed.codes.device).items():    # split-K workspace: not saved
            self.register_buffer(f"split_{key}", buf, persistent=False)
        self._op = None
        self.register_kernel(op_name)

    @classmethod
    def from_weight(cls, folder, weight: torch.Tensor, bias: torch.Tensor | None = None, block_mask=None,
                    spec: Fp8GemvSpec | None = None, scales: torch.Tensor | None = None,
                    op_name: str = "fp8_gemv") -> Fp8LinearCUDA:
        """Quantise (a 16/32-bit ``weight``) or take (``float8_e4m3fn`` codes with ``scales``) and pack, keeping the
        blocks of ``block_mask`` for a block-sparse spec (``spec``: the folder's ``spec.json`` if not given); the
        rows are the spec's. Packs on the weight's device."""
        spec = folder_spec(folder) if spec is None else spec
        check_saved_spec(op_name, folder, spec)
        if weight.dtype == torch.float8_e4m3fn:
            if scales is None:
                raise Fp8GemvError(f"FP8 GEMV {spec.name}: E4M3 codes need their scales {spec.scale_shape}")
            packed = pack_codes(weight, scales.to(weight.device), spec, block_mask)
        else:
            if scales is not None:
                raise Fp8GemvError(f"FP8 GEMV {spec.name}: scales go with E4M3 codes; a {weight.dtype} weight is "
                                   "quantised here")
            packed = pack_weight(weight, spec, block_mask)
        return cls(folder, spec, packed, bias, op_name)

    @property
    def packed(self) -> Fp8Packed:
        return Fp8Packed(self.codes, self.scales, self.table)

    def dense_weight(self) -> torch.Tensor:
        """The (N, K) fp32 weight the kernel applies (code × scale, zeros where pruned), on the CPU."""
        return dequantize(self.packed.to("cpu"), self.spec)

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "spec": dataclasses.asdict(self.spec), "folder": folder.name}
        tensors = {"codes": self.codes, "scales": self.scales}
        for name in ("table", "bias"):
            if self._buffers.get(name) is not None:
                tensors[name] = self._buffers[name]
        return config, tensors, {folder.name: folder}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> Fp8LinearCUDA:
        spec = Fp8GemvSpec(**config["spec"])
        folder = folders[config["folder"]]
        check_saved_spec(config["op_name"], folder, spec)
        packed = Fp8Packed(tensors["codes"], tensors["scales"], tensors.get("table"))
        return cls(folder, spec, packed, tensors.get("bias"), config["op_name"])

    def extra_repr(self) -> str:
        s = self.spec
        blocks = self.codes.numel() * 4 // 1024
        return (f"{self.op_name}: N={s.n}, K={s.k}, up to {s.rows} rows, {s.dtype}, E4M3 {s.scale} scales, "
                f"{'block-sparse' if s.sparse else 'dense'} ({blocks} of {s.row_blocks * s.col_blocks} blocks), "
                f"act={s.act}, bias={s.bias}")


__all__ = ["Fp8LinearCUDA", "Fp8GemvOp", "folder_spec"]
