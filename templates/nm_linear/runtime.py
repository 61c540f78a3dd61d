"""sparta's 2:4 sparse linear (``templates/nm_linear/``) from torch, without TVM.

:class:`NmLinearOp` runs the kernel on device tensors; :class:`NmLinearCUDA` is the kernel module (a linear of the
packed weight for up to ``spec.rows`` rows, any leading dimensions): its op ``sparta::nm_linear`` (defined for every
registered family in ``sparta/runtime/ops.py``) takes ``[x (M, K)]`` and the packed tensors, and has a fake
implementation, so it runs inside ``torch.compile`` graphs and CUDA graph captures. A ``ksplit > 1`` kernel's
workspace (fp32 partials, arrival counters the kernel leaves at zero) is a module buffer: one call at a time per
module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .spec import DTYPES, NmLinearError, NmLinearSpec, NmPacked, pack_nm, split_buffers, unpack
from ...runtime.cuda import GraphWeightLayout, check_saved_spec, kernel_file
from ...runtime.ops import KernelModule
from ..packed_gemv import GraphGemv, PackedGemvModule, PackedGemvOp


def folder_spec(folder) -> NmLinearSpec:
    """The spec a kernel folder was built from (its ``spec.json``)."""
    return NmLinearSpec(**json.loads(kernel_file(folder, "spec.json")))


def check_packed(spec: NmLinearSpec, packed: NmPacked, bias: torch.Tensor | None) -> None:
    """Refuse packed tensors (or a bias) that do not fit ``spec``."""
    where = f"2:4 sparse linear {spec.name}"
    want = (spec.row_tiles, spec.k_tiles, 32, 8)
    if tuple(packed.values.shape) != want or packed.values.dtype != DTYPES[spec.dtype]:
        raise NmLinearError(f"{where}: values must be {spec.dtype} {want}, got {packed.values.dtype} "
                            f"{tuple(packed.values.shape)} (packed for another spec?)")
    want = (spec.row_tiles, spec.groups, 16, 4)
    if tuple(packed.meta.shape) != want or packed.meta.dtype != torch.int32:
        raise NmLinearError(f"{where}: meta must be int32 {want}, got {packed.meta.dtype} {tuple(packed.meta.shape)}")
    if spec.bias and (bias is None or tuple(bias.shape) != (spec.n,)):
        raise NmLinearError(f"{where}: the kernel adds a bias of shape ({spec.n},); pass one")
    if not spec.bias and bias is not None:
        raise NmLinearError(f"{where}: the kernel was built without a bias")


class NmLinearOp(PackedGemvOp):
    """The 2:4 kernel on device tensors (:class:`~..packed_gemv.PackedGemvOp`; X rows read in 16-byte pieces)."""

    label, error, align_x = "2:4 sparse linear", NmLinearError, True
    check, split_buffers = staticmethod(check_packed), staticmethod(split_buffers)

    def weights(self) -> dict:
        p = self.packed
        return dict(Vals=p.values.view(torch.int32).view(-1), Meta=p.meta.view(-1))


class NmLinearCUDA(GraphGemv, PackedGemvModule, GraphWeightLayout, KernelModule):
    """``y = act(x · (W ⊙ mask)ᵀ + b)`` on the 2:4 sparse tensor cores (the op ``sparta::nm_linear``) for ``x``
    (..., K) with at most ``spec.rows`` rows in all, or more from ``dense_from`` rows on, which run cuBLAS over a
    dense copy; ``y`` in ``x``'s dtype. ``few`` (``(folder, spec)``): a kernel built for fewer rows over the same
    packed weight, run for calls of up to its rows. In a compiled graph it stands for op ``op_name``
    (:class:`GraphGemv`)."""

    kernel_family = "nm_linear"
    op_class, packed_names = NmLinearOp, ("values", "meta")
    weight_names = ("values", "meta", "bias")
    plan_tensors = ("meta",)        # what a kernels-only save keeps: the 2-bit indices (the mask), not the values

    def __init__(self, folder, spec: NmLinearSpec, packed: NmPacked, bias: torch.Tensor | None = None,
                 op_name: str = "nm_linear", x_name: str | None = None, out_shape: tuple | None = None,
                 dense_from: int | None = None, few: tuple | None = None):
        super().__init__()
        bias = bias.detach().to(DTYPES[spec.dtype]).contiguous() if bias is not None else None
        check_packed(spec, packed, bias)
        self.few_folder, self.few_spec = (None, None) if few is None else (str(few[0]), few[1])
        if few is not None:
            check_saved_spec(op_name, few[0], few[1])
            if (few[1].n, few[1].k, few[1].dtype, few[1].bias, few[1].act) != (spec.n, spec.k, spec.dtype, spec.bias,
                                                                                 spec.act) or few[1].rows >= spec.rows:
                raise NmLinearError(f"2:4 sparse linear {spec.name}: its few-row kernel {few[1].name} must compute "
                                    f"the same linear for fewer than {spec.rows} rows")
            for key, buf in split_buffers(few[1], packed.values.device).items():
                self.register_buffer(f"few_split_{key}", buf, persistent=False)
        self._few_op = None
        self.folder, self.spec, self.op_name = str(folder), spec, op_name
        self.register_buffer("values", packed.values)
        self.register_buffer("meta", packed.meta)
        self.register_buffer("bias", bias)
        for key, buf in split_buffers(spec, packed.values.device).items():    # split-K workspace: not saved
            self.register_buffer(f"split_{key}", buf, persistent=False)
        self._op = None
        self.init_graph(x_name, out_shape, dense_from)
        self.register_kernel(op_name)

    @classmethod
    def from_weight(cls, folder, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int | None = None,
                    mask: torch.Tensor | None = None, spec: NmLinearSpec | None = None,
                    op_name: str = "nm_linear") -> NmLinearCUDA:
        """Pack ``weight`` where ``mask`` (default: its nonzeros; it must be 2:4). ``spec``: the folder's
        ``spec.json`` if not given; ``rows``: refused if the kernel serves fewer rows."""
        spec = folder_spec(folder) if spec is None else spec
        check_saved_spec(op_name, folder, spec)
        if rows is not None and rows > spec.rows:
            raise NmLinearError(f"2:4 sparse linear {spec.name}: built for {spec.rows} rows, asked for {rows}")
        return cls(folder, spec, pack_nm(weight, spec, mask), bias, op_name)

    @property
    def packed(self) -> NmPacked:
        return NmPacked(self.values, self.meta)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        x = inputs[0]
        if self.few_spec is None or x.shape[0] > self.few_spec.rows or not (x.is_cuda and self.values.is_cuda):
            return GraphGemv.launch(self, inputs)
        key = (self.values.data_ptr(), self.meta.data_ptr())
        if self._few_op is None or self._few_op[0] != key:
            split = {"P": self.few_split_P, "Cnt": self.few_split_Cnt} if self.few_spec.ksplit > 1 else {}
            self._few_op = key, NmLinearOp(self.few_folder, self.few_spec, self.packed, self.bias, split)
        return [self._few_op[1](x)]

    def dense_weight(self) -> torch.Tensor:
        """The (N, K) weight the kernel applies (zeros where pruned), on the CPU."""
        return unpack(NmPacked(self.values.cpu(), self.meta.cpu()), self.spec)[0]

    def packed_source(self) -> torch.Tensor:
        return self.values

    def unpacked(self) -> torch.Tensor:
        """The dense (N, K) weight on the packed values' device (:class:`DenseRows`)."""
        return unpack(self.packed, self.spec, self.values.device)[0]

    def repack(self, graph, op_plan) -> None:
        """Pack the graph's weight (a checkpoint's) again over the plan's mask, as the build does."""
        from ...codegen.cuda_bind import gemm_parts
        parts = gemm_parts(graph, graph.op(self.op_name), op_plan)
        keep = op_plan.kept(self.spec.n, self.spec.k)
        packed = pack_nm(parts.site.weight.to(DTYPES[self.spec.dtype]), self.spec, keep)
        self._buffers["values"], self._buffers["meta"] = packed.values, packed.meta
        if parts.bias is not None:
            self._buffers["bias"] = parts.bias.to(DTYPES[self.spec.dtype]).contiguous()
        self._op, self._few_op, self.dense_w = None, None, None

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "spec": dataclasses.asdict(self.spec), "folder": folder.name,
                  **self.graph_config()}
        folders = {folder.name: folder}
        if self.few_spec is not None:
            few = Path(self.few_folder)
            config["few"] = {"spec": dataclasses.asdict(self.few_spec), "folder": few.name}
            folders[few.name] = few
        tensors = {"values": self.values, "meta": self.meta}
        if self.bias is not None:
            tensors["bias"] = self.bias
        return config, tensors, folders

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> NmLinearCUDA:
        spec = NmLinearSpec(**config["spec"])
        folder = folders[config["folder"]]
        check_saved_spec(config["op_name"], folder, spec)
        few = config.get("few")
        few = None if few is None else (folders[few["folder"]], NmLinearSpec(**few["spec"]))
        return cls(folder, spec, NmPacked(tensors["values"], tensors["meta"]), tensors.get("bias"), config["op_name"],
                   **cls.graph_args(config), few=few).restore_graph(config)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"{self.op_name}: N={s.n}, K={s.k}, up to {s.rows} rows, {s.dtype}, 2:4 ({self.values.numel()} "
                f"value slots), act={s.act}, bias={s.bias}"
                + (f", up to {self.few_spec.rows} rows on {self.few_spec.name}" if self.few_spec else "")
                + self.dense_rows_repr())


__all__ = ["NmLinearCUDA", "NmLinearOp", "check_packed", "folder_spec"]
