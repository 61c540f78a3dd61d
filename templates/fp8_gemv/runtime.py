"""sparta's FP8 GEMV (``templates/fp8_gemv/``) from torch, without TVM.

:class:`Fp8GemvOp` runs the kernel on device tensors; :class:`Fp8LinearCUDA` is the kernel module (a linear of the
packed E4M3 weight for up to ``spec.rows`` rows, any leading dimensions): its op ``sparta::fp8_gemv`` (defined for
every family in ``sparta/runtime/ops.py``) takes ``[x (M, K)]`` and the packed tensors and has a fake
implementation, so it runs inside ``torch.compile`` graphs and CUDA graph captures. A ``ksplit > 1`` kernel's
workspace is a module buffer: one call at a time per module. In a compiled graph (``graph_build.py``) it stands for a
planned linear of FP8 weights, its calls of ``dense_from`` rows or more on cuBLAS over the weight the
dequantisation kernel (``dequant.py``) writes at each call (a module built without one: a dense copy).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .spec import (DTYPES, Fp8GemvError, Fp8GemvSpec, Fp8Packed, check_packed, dequantize, pack_codes, pack_weight,
                   split_buffers)
from ...runtime.cuda import GraphWeightLayout, check_saved_spec, kernel_file
from ...runtime.ops import KernelModule
from ..packed_gemv import GraphGemv, PackedGemvModule, PackedGemvOp
from .dequant import Fp8DequantOp, Fp8DequantSpec, dequant_ref


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


class Fp8LinearCUDA(GraphGemv, PackedGemvModule, GraphWeightLayout, KernelModule):
    """``y = act(x · (s ⊙ W8)ᵀ + b)`` on the FP8 GEMV (the op ``sparta::fp8_gemv``) for ``x`` (..., K) with at most
    ``spec.rows`` rows in all, or more from ``dense_from`` rows on (cuBLAS over the weight dequantised per call, or
    over a dense copy); ``y`` in ``x``'s dtype. In a compiled graph it stands for op ``op_name`` (:class:`GraphGemv`)."""

    kernel_family = "fp8_gemv"
    op_class, packed_names = Fp8GemvOp, ("codes", "scales")
    dequant_kinds = (Fp8DequantSpec, Fp8DequantOp)      # many-row calls: the codes dequantised per call
    weight_names = ("codes", "scales", "table", "bias")

    def __init__(self, folder, spec: Fp8GemvSpec, packed: Fp8Packed, bias: torch.Tensor | None = None,
                 op_name: str = "fp8_gemv", x_name: str | None = None, out_shape: tuple | None = None,
                 dense_from: int | None = None):
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
        self.init_graph(x_name, out_shape, dense_from)
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

    def plan_tensors(self) -> set[str]:
        """What a kernels-only save keeps: the block table of a block-sparse weight (its mask), not the codes."""
        return {"table"} if self.spec.sparse else set()

    def packed_source(self) -> torch.Tensor:
        return self.codes

    def dequant_fits(self, spec: Fp8DequantSpec) -> bool:
        return spec == Fp8DequantSpec.for_gemv(self.spec)

    def dequantised(self, op: Fp8DequantOp) -> torch.Tensor:
        return op(self.packed)

    def dequant_reference(self) -> torch.Tensor:
        return dequant_ref(self.packed, self.dequant[1], self.codes.device)

    def unpacked(self) -> torch.Tensor:
        """The dequantised (N, K) weight in the kernel's dtype on the codes' device (:class:`DenseRows`)."""
        return dequantize(self.packed, self.spec, self.codes.device).to(DTYPES[self.spec.dtype])

    def repack(self, graph, op_plan) -> None:
        """Quantise and pack the graph's weight (a checkpoint's) again over the plan's blocks, as the build does."""
        from ...codegen.cuda_bind import gemm_parts
        from ...passes.transform.fp8 import fp8_block_grid
        parts = gemm_parts(graph, graph.op(self.op_name), op_plan)
        grid = fp8_block_grid(op_plan.subops[0].elements) if self.spec.sparse else None
        weight = parts.site.weight
        packed = pack_weight(weight, self.spec, None if grid is None else grid.to(weight.device))
        for name, value in (("codes", packed.codes), ("scales", packed.scales), ("table", packed.table)):
            self._buffers[name] = value
        if parts.bias is not None:
            self._buffers["bias"] = parts.bias.to(DTYPES[self.spec.dtype]).contiguous()
        self._op, self.dense_w = None, None

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "spec": dataclasses.asdict(self.spec), "folder": folder.name,
                  **self.graph_config()}
        folders = self.dense_rows_config()[1] if self.input_names is not None else {}
        tensors = {"codes": self.codes, "scales": self.scales}
        for name in ("table", "bias"):
            if self._buffers.get(name) is not None:
                tensors[name] = self._buffers[name]
        return config, tensors, {folder.name: folder, **folders}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> Fp8LinearCUDA:
        spec = Fp8GemvSpec(**config["spec"])
        folder = folders[config["folder"]]
        check_saved_spec(config["op_name"], folder, spec)
        packed = Fp8Packed(tensors["codes"], tensors["scales"], tensors.get("table"))
        module = cls(folder, spec, packed, tensors.get("bias"), config["op_name"], **cls.graph_args(config))
        module.restore_dequant(config, folders)
        return module.restore_graph(config)

    def extra_repr(self) -> str:
        s = self.spec
        blocks = self.codes.numel() * 4 // 1024
        return (f"{self.op_name}: N={s.n}, K={s.k}, up to {s.rows} rows, {s.dtype}, E4M3 {s.scale} scales, "
                f"{'block-sparse' if s.sparse else 'dense'} ({blocks} of {s.row_blocks * s.col_blocks} blocks), "
                f"act={s.act}, bias={s.bias}{self.dense_rows_repr()}")


__all__ = ["Fp8LinearCUDA", "Fp8GemvOp", "folder_spec"]
