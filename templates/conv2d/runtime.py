"""sparta's block-sparse convolution kernel (``templates/conv2d/``) from torch, without TVM.

``Conv2dOp(folder, spec, wp, table, bias)(x, residual)`` runs the kernel on torch's current stream over channels-last
``x`` (NB, H, W, Cin) into a fresh ``(NB, OH, OW, Cout)``. :class:`Conv2dCUDA` is the kernel module (op
``sparta::conv2d``): it holds the packed blocks, the table and the bias, takes torch's ``(NB, Cin, H, W)`` layout
(a permuted view of a channels-last tensor costs nothing; another is copied) and returns ``(NB, Cout, OH, OW)``
channels-last, inside ``torch.compile`` graphs and CUDA graph captures alike.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .spec import DTYPES, Conv2dSpec, block_mask_of, check_inputs, pack_weight
from ...runtime.cuda import CudaKernel, CudaRuntimeError, check_saved_spec, kernel_file, lanes16
from ...runtime.ops import KernelModule


def folder_spec(folder) -> Conv2dSpec:
    """The spec a kernel folder was built from (its ``spec.json``)."""
    return Conv2dSpec(**json.loads(kernel_file(folder, "spec.json")))


class Conv2dOp:
    """One kernel over packed blocks: ``op(x, residual=None)`` with channels-last ``x`` (NB, H, W, Cin)."""

    def __init__(self, folder, spec: Conv2dSpec, wp: torch.Tensor, table: torch.Tensor, bias: torch.Tensor):
        self.spec, self.kernel = spec, CudaKernel(folder)
        self.wp, self.table, self.bias = lanes16(wp.reshape(-1)), table, lanes16(bias)
        self._prepared = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        nb = check_inputs(s, x, residual)
        if not x.is_cuda:
            raise CudaRuntimeError(f"conv2d {s.name} runs on a CUDA GPU; x is on {x.device}")
        y = torch.empty(nb, s.oh, s.ow, s.cout, dtype=x.dtype, device=x.device)
        if nb == 0:
            return y
        args = dict(X=lanes16(x.contiguous()), Wp=self.wp, B=self.bias, Tab=self.table,
                    Y=lanes16(y).view(s.rows(nb), s.cout))
        if residual is not None:
            args["RR"] = lanes16(residual.contiguous()).view(s.rows(nb), s.cout)
        per_call = ("X", "Y") + (("RR",) if residual is not None else ())
        if self._prepared is None or self._prepared.device != x.device.index:
            self._prepared = self.kernel.prepare(tuple(n for n in per_call if n in self.kernel_names()), **args)
        else:
            self._prepared.launch(**{n: args[n] for n in per_call if n in self.kernel_names()})
        return y

    def kernel_names(self) -> set[str]:
        return {a["name"] for a in self.kernel.tensor_args}


class Conv2dCUDA(KernelModule):
    """A convolution run by its ``conv2d`` kernel (op ``sparta::conv2d``): ``module(x)`` or ``module(x, residual)``
    with ``x`` (NB, Cin, H, W) and ``residual`` (NB, Cout, OH, OW) in the spec's dtype; returns (NB, Cout, OH, OW),
    channels-last in memory."""

    kernel_family = "conv2d"
    weight_names = ("wp", "table", "bias")

    def __init__(self, op_name: str, folder, spec: Conv2dSpec, wp: torch.Tensor, table: torch.Tensor,
                 bias: torch.Tensor | None):
        super().__init__()
        self.op_name, self.folder, self.spec = op_name, str(folder), spec
        dtype = DTYPES[spec.dtype]
        if wp.dim() != 3 or tuple(wp.shape[1:]) != (spec.bn, spec.bk):
            raise CudaRuntimeError(f"op {op_name!r}: packed blocks must be (nnz, {spec.bn}, {spec.bk})")
        nnz = int(table[spec.row_blocks]) if table.numel() > spec.row_blocks else -1
        if nnz < 0 or table.numel() != spec.row_blocks + 1 + nnz or wp.shape[0] < max(nnz, 1):
            raise CudaRuntimeError(f"op {op_name!r}: the table must hold {spec.row_blocks + 1} offsets and one K "
                                   "block per packed block, the packed blocks at least one block")
        self.input_names = None          # in a compiled graph: the activation it reads (not the op's weight and bias)
        self.register_buffer("wp", wp.to(dtype).contiguous())
        self.register_buffer("table", table.to(torch.int32).contiguous())
        self.register_buffer("bias", (bias if bias is not None else torch.zeros(spec.cout)).to(dtype).contiguous())
        self._op = None
        self.register_kernel(op_name)

    @classmethod
    def from_weight(cls, op_name: str, folder, spec: Conv2dSpec, weight: torch.Tensor, bias: torch.Tensor | None,
                    blocks: torch.Tensor | None = None) -> Conv2dCUDA:
        """Pack ``weight`` (Cout, Cin, KH, KW): the blocks of ``blocks`` (default: those holding a nonzero)."""
        wp, table = pack_weight(weight.detach().cpu().to(DTYPES[spec.dtype]), spec, blocks)
        return cls(op_name, folder, spec, wp, table, bias)

    @property
    def block_mask(self) -> torch.Tensor:
        """(row blocks, K blocks) bool: the blocks the kernel reads."""
        s, t = self.spec, self.table.cpu()
        out = torch.zeros(s.row_blocks, s.k_blocks, dtype=torch.bool)
        for r in range(s.row_blocks):
            out[r, t[s.row_blocks + 1 + t[r]: s.row_blocks + 1 + t[r + 1]].long()] = True
        return out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        inputs = [x.permute(0, 2, 3, 1).contiguous()]
        if residual is not None:
            inputs.append(residual.permute(0, 2, 3, 1).contiguous())
        return self.call_kernel(*inputs)[0].permute(0, 3, 1, 2)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        x = inputs[0]
        if not x.is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r} was compiled for CUDA; move the module and inputs to a GPU "
                                   "(module.to('cuda'))")
        if not self.wp.is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r}: its weights are on the CPU; call module.to('cuda')")
        if self._op is None or self._op.wp.data_ptr() != lanes16(self.wp).reshape(-1).data_ptr():
            self._op = Conv2dOp(self.folder, self.spec, self.wp, self.table, self.bias)
        return [self._op(x, inputs[1] if len(inputs) > 1 else None)]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        x, s = inputs[0], self.spec
        return [x.new_empty((x.shape[0], s.oh, s.ow, s.cout))]

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "spec": dataclasses.asdict(self.spec), "kernel": folder.name,
                  "input_names": list(self.input_names) if self.input_names is not None else None}
        return config, {"wp": self.wp, "table": self.table, "bias": self.bias}, {folder.name: folder}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> Conv2dCUDA:
        spec = Conv2dSpec(**config["spec"])
        folder = folders[config["kernel"]]
        check_saved_spec(config["op_name"], folder, spec)
        module = cls(config["op_name"], folder, spec, tensors["wp"], tensors["table"], tensors["bias"])
        module.input_names = config.get("input_names")
        return module

    def extra_repr(self) -> str:
        s = self.spec
        nnz = int(self.table[s.row_blocks])
        return (f"{self.op_name}: {s.cin}->{s.cout}, {s.kh}x{s.kw}, stride {s.stride}, padding {s.padding}, "
                f"{s.dtype}, {nnz}/{s.row_blocks * s.k_blocks} blocks of {s.bn}x{s.bk}")


__all__ = ["Conv2dCUDA", "Conv2dOp", "folder_spec", "block_mask_of"]
