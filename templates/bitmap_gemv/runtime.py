"""sparta's bitmap GEMV (``templates/bitmap_gemv/``) from torch, without TVM.

:class:`BitmapGemvOp` runs the kernel on device tensors; :class:`BitmapLinearCUDA` is the kernel module (a linear of
the packed weight for up to ``spec.rows`` rows, any leading dimensions): its op ``sparta::bitmap_gemv`` (defined for
every family in ``sparta/runtime/ops.py``) takes ``[x (M, K)]`` and the packed tensors, and has a fake implementation,
so it runs inside ``torch.compile`` graphs and CUDA graph captures. A ``ksplit > 1`` kernel's workspace (fp32
partials, arrival counters the kernel leaves at zero) is a module buffer: one call at a time per module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .spec import DTYPES, BitmapGemvError, BitmapGemvSpec, BitmapPacked, pack_bitmap, split_buffers, unpack
from ...runtime.cuda import check_saved_spec, kernel_file, lanes16
from ...runtime.ops import KernelModule
from ..packed_gemv import PackedGemvModule, PackedGemvOp


def folder_spec(folder) -> BitmapGemvSpec:
    """The spec a kernel folder was built from (its ``spec.json``)."""
    return BitmapGemvSpec(**json.loads(kernel_file(folder, "spec.json")))


def check_packed(spec: BitmapGemvSpec, packed: BitmapPacked, bias: torch.Tensor | None) -> None:
    """Refuse packed tensors (or a bias) that do not fit ``spec``."""
    where = f"bitmap GEMV {spec.name}"
    if tuple(packed.bits.shape) != (spec.tiles, spec.words // 4, 32, 4) or packed.bits.dtype != torch.int32:
        raise BitmapGemvError(f"{where}: bits must be int32 {(spec.tiles, spec.words // 4, 32, 4)}, got "
                              f"{packed.bits.dtype} {tuple(packed.bits.shape)} (packed for another spec?)")
    if tuple(packed.offsets.shape) != (spec.tiles + 1,) or packed.offsets.dtype != torch.int32:
        raise BitmapGemvError(f"{where}: offsets must be int32 ({spec.tiles + 1},)")
    if packed.values.dim() != 1 or packed.values.dtype != DTYPES[spec.dtype] or packed.values.numel() % 8:
        raise BitmapGemvError(f"{where}: values must be a 1-d {spec.dtype} tensor of whole pieces of 8")
    if spec.bias and (bias is None or tuple(bias.shape) != (spec.n,)):
        raise BitmapGemvError(f"{where}: the kernel adds a bias of shape ({spec.n},); pass one")
    if not spec.bias and bias is not None:
        raise BitmapGemvError(f"{where}: the kernel was built without a bias")


class BitmapGemvOp(PackedGemvOp):
    """The bitmap GEMV on device tensors (:class:`~..packed_gemv.PackedGemvOp`)."""

    label, error = "bitmap GEMV", BitmapGemvError
    check, split_buffers = staticmethod(check_packed), staticmethod(split_buffers)

    def weights(self) -> dict:
        p = self.packed
        return dict(Bits=p.bits.view(-1), Off=p.offsets, Vals=lanes16(p.values))


class BitmapLinearCUDA(PackedGemvModule, KernelModule):
    """``y = act(x · (W ⊙ mask)ᵀ + b)`` on the bitmap GEMV (the op ``sparta::bitmap_gemv``) for ``x`` (..., K) with
    at most ``spec.rows`` rows in all; ``y`` in ``x``'s dtype."""

    kernel_family = "bitmap_gemv"
    op_class, packed_names = BitmapGemvOp, ("bits", "values")
    weight_names = ("bits", "offsets", "values", "bias")

    def __init__(self, folder, spec: BitmapGemvSpec, packed: BitmapPacked, bias: torch.Tensor | None = None,
                 op_name: str = "bitmap_gemv"):
        super().__init__()
        dtype = DTYPES[spec.dtype]
        bias = bias.detach().to(dtype).contiguous() if bias is not None else None
        check_packed(spec, packed, bias)
        self.folder, self.spec, self.op_name = str(folder), spec, op_name
        self.register_buffer("bits", packed.bits)
        self.register_buffer("offsets", packed.offsets)
        self.register_buffer("values", packed.values)
        self.register_buffer("bias", bias)
        for key, buf in split_buffers(spec, packed.values.device).items():    # split-K workspace: not saved
            self.register_buffer(f"split_{key}", buf, persistent=False)
        self._op = None
        self.register_kernel(op_name)

    @classmethod
    def from_weight(cls, folder, weight: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None,
                    spec: BitmapGemvSpec | None = None, op_name: str = "bitmap_gemv") -> BitmapLinearCUDA:
        """Pack ``weight`` where ``mask`` (``spec``: the folder's ``spec.json`` if not given)."""
        spec = folder_spec(folder) if spec is None else spec
        check_saved_spec(op_name, folder, spec)
        return cls(folder, spec, pack_bitmap(weight, mask, spec), bias, op_name)

    @property
    def packed(self) -> BitmapPacked:
        return BitmapPacked(self.bits, self.offsets, self.values)

    def dense_weight(self) -> torch.Tensor:
        """The (N, K) weight the kernel applies (zeros where pruned), on the CPU."""
        return unpack(BitmapPacked(self.bits.cpu(), self.offsets.cpu(), self.values.cpu()), self.spec)[0]

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "spec": dataclasses.asdict(self.spec), "folder": folder.name}
        tensors = {"bits": self.bits, "offsets": self.offsets, "values": self.values}
        if self.bias is not None:
            tensors["bias"] = self.bias
        return config, tensors, {folder.name: folder}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> BitmapLinearCUDA:
        spec = BitmapGemvSpec(**config["spec"])
        folder = folders[config["folder"]]
        check_saved_spec(config["op_name"], folder, spec)
        packed = BitmapPacked(tensors["bits"], tensors["offsets"], tensors["values"])
        return cls(folder, spec, packed, tensors.get("bias"), config["op_name"])

    def extra_repr(self) -> str:
        s = self.spec
        kept = self.values.numel()
        return (f"{self.op_name}: N={s.n}, K={s.k}, up to {s.rows} rows, {s.dtype}, {kept} value slots "
                f"({kept / (s.n * s.k):.1%} of dense), act={s.act}, bias={s.bias}")


__all__ = ["BitmapLinearCUDA", "BitmapGemvOp", "check_packed", "folder_spec"]
