"""A W8A8 linear on few rows running sparta's W8A8 GEMV (``templates/w8a8_gemv/``), no TVM.

:class:`W8A8GemvCUDA` is the graph module ``compile(target="cuda")`` puts in place of a dense linear that
calibration ran at int8 weights and activations when the op has at most 16 activation rows (decode): int8
codes per channel with their fp32 scales (a sparse op: only its kept 16×32 chunks, with their table), bias and
activation fused. Its input is quantised per token on the
way in, or arrives as codes and scales (:class:`~sparta.templates.quant.runtime.QuantizedInput`). It saves and loads
without TVM like :class:`~sparta.templates.bsr_linear.runtime.SparseLinearCUDA`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..quant.spec import quantize_rows
from .spec import W8A8GemvSpec, pack_weight, unpack_weight
from ...runtime.cuda import (CudaKernel, CudaRuntimeError, GraphWeightLayout, act16_dtype, check_fp16_input, check_saved_spec,
                   lanes16)
from ...runtime.ops import KernelModule
from ..quant.runtime import QuantizedLinear, RowQuantizer, output_scale_arg


def _check_weight(what: str, spec: W8A8GemvSpec, wq: torch.Tensor, weight_scale: torch.Tensor,
                  table: torch.Tensor | None) -> None:
    if spec.blocks:                    # a dense bsr_linear int8 tile's blocks and table: every block, read in K order
        kept = table.numel() - 3 * spec.row_blocks if table is not None else -1
        if kept != spec.row_blocks * -(-spec.k // spec.bk):
            kept = -1
        want = spec.weight_shape(max(kept, wq.shape[0] if wq.dim() == 3 else 0))
    else:
        kept = table.numel() - spec.tiles - 1 if table is not None else 0
        want = spec.weight_shape(kept)
    if wq.shape != want or wq.dtype != torch.int8 or weight_scale.shape != (spec.n,):
        raise CudaRuntimeError(f"{what}: weights must be int8 codes of shape {want} (w8a8_gemv.spec.pack_weight) and "
                               f"({spec.n},) scales, not {tuple(wq.shape)} {wq.dtype} / {tuple(weight_scale.shape)}")
    tabled = spec.sparse or spec.blocks
    if tabled != (table is not None) or (table is not None and (table.dtype != torch.int32 or kept < 0)):
        raise CudaRuntimeError(f"{what}: " + ("the kernel takes the int32 table of pack_weight (blocks: the tile's)"
                                              if tabled else "a table is for the sparse kernel"))


class W8A8GemvOp:
    """The kernel on device tensors: ``op(xq, xs)`` for per-token int8 codes ``(M, K)`` and fp32 scales ``(M,)``;
    ``wq`` and (sparse) ``table`` as ``w8a8_gemv.spec.pack_weight`` returns them."""

    def __init__(self, folder, spec: W8A8GemvSpec, wq: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, out_scale: float | None = None, table: torch.Tensor | None = None):
        _check_weight(spec.name, spec, wq, weight_scale, table)
        if spec.bias and bias is None:
            raise CudaRuntimeError(f"{spec.name}: the kernel adds a bias; pass one")
        if (spec.out == "int8") != (out_scale is not None):
            raise CudaRuntimeError(f"{spec.name}: " + ("the kernel writes int8 codes; pass out_scale" if out_scale is None
                                                       else "out_scale is for out='int8' kernels"))
        self.kernel, self.spec = CudaKernel(folder), spec
        dev = wq.device
        self.wq = wq.contiguous()
        self.weight_scale = weight_scale.float().contiguous().to(dev)
        self.bias = bias.to(act16_dtype(spec)).contiguous().to(dev) if spec.bias else None
        self.out_scale = None if out_scale is None else output_scale_arg(out_scale, dev)
        self.table = None if table is None else table.contiguous().to(dev)
        self._prepared = None

    def __call__(self, xq: torch.Tensor, xs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        rows = xq.shape[0] if xq.dim() == 2 else -1
        if xq.dim() != 2 or xq.shape[1] != s.k or not (rows == s.m or not s.m and rows <= s.rows) \
                or xq.dtype != torch.int8 or not xq.is_contiguous() or xs.numel() != rows:
            raise CudaRuntimeError(f"{s.name}: takes contiguous int8 ({s.m or f'M <= {s.rows}'}, {s.k}) codes and as "
                                   "many fp32 scales")
        dtype = torch.int8 if s.out == "int8" else act16_dtype(s)
        y = torch.empty(rows, s.n, dtype=dtype, device=xq.device) if out is None else out
        if rows == 0:                  # a kernel of any M reads row M - 1 for its padding rows: none to read
            return y
        xw, xs, y16 = xq.view(torch.int32), xs.float().contiguous(), lanes16(y)
        if self._prepared is None:
            self._prepared = self.kernel.prepare(("XQ", "XS", "Y"), XQ=xw, XS=xs, WQ=self.wq.view(torch.int32),
                                                 WS=self.weight_scale, Y=y16,
                                                 **({"B": lanes16(self.bias)} if s.bias else {}),
                                                 **({"OS": self.out_scale} if s.out == "int8" else {}),
                                                 **({"Tab": self.table} if s.sparse else {}))
        else:
            self._prepared.launch(XQ=xw, XS=xs, Y=y16)
        return y


class W8A8GemvCUDA(QuantizedLinear, GraphWeightLayout, KernelModule):
    """One graph op run by the W8A8 GEMV: ``y = act(q(x) · Ŵᵀ + b)`` for the op's ``(M, K)`` input, ``q`` the
    per-token int8 quantisation (the kernel in ``quant_folder``, torch ops without one, or none when the input
    arrives quantised), ``Ŵ`` int8 codes per channel (``wq``, in the kernel's layout) times ``weight_scale``; the
    quantiser and the GEMV run as the op ``sparta::w8a8_gemv``."""

    reads_int8 = True
    kernel_family = "w8a8_gemv"
    weight_names = ("wq", "weight_scale", "bias", "table")

    def __init__(self, op_name: str, x_name: str, folder, spec: W8A8GemvSpec, wq: torch.Tensor,
                 weight_scale: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple, quant_folder=None,
                 table: torch.Tensor | None = None):
        super().__init__()
        _check_weight(f"op {op_name!r}", spec, wq, weight_scale, table)
        if spec.bias and bias is None:
            raise CudaRuntimeError(f"op {op_name!r}: the kernel adds a bias; pass one")
        self.op_name, self.input_names, self.folder, self.spec = op_name, [x_name], str(folder), spec
        self.register_buffer("wq", wq.contiguous())
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", bias.to(act16_dtype(spec)) if bias is not None else None)
        self.register_buffer("table", table)
        self.quant_folder = str(quant_folder) if quant_folder else None
        self.out_shape = tuple(out_shape)
        self.weight_name, self.weight_transposed = None, False
        self.out_dtype = None
        self.output_names, self.out_scale = None, None     # set by requantize_output
        self._op, self._quantizer = None, None
        self.register_kernel(op_name)

    def requantize_output(self, names: list[str], scale: float, kernel: tuple | None = None) -> None:
        """Return the int8 codes of the output at the static ``scale`` and that scale per row, as the graph tensors
        ``names`` (codes, scales). ``kernel`` = (folder, spec): the same GEMV built with ``out="int8"`` (default: the
        current one already is)."""
        if kernel is not None:
            self.folder, self.spec = str(kernel[0]), kernel[1]
        if self.spec.out != "int8":
            raise CudaRuntimeError(f"op {self.op_name!r}: requantising needs a GEMV built with out='int8'")
        self._requantized(names, scale, self.spec.m, self.wq.device)

    @classmethod
    def from_weight(cls, op_name: str, x_name: str, folder, spec: W8A8GemvSpec, weight: torch.Tensor,
                    weight_scale: torch.Tensor | None, bias: torch.Tensor | None, out_shape: tuple,
                    quant_folder=None) -> W8A8GemvCUDA:
        """Quantise ``weight`` (N, K) per channel at ``weight_scale`` (fitted, e.g. by calibration; default: each
        channel's absolute maximum / 127), as the W8A8 tile kernels do."""
        if weight_scale is None:
            codes, weight_scale = quantize_rows(weight)
        else:
            codes = torch.round(weight.float() / weight_scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        wq, table = pack_weight(spec, codes)
        return cls(op_name, x_name, folder, spec, wq, weight_scale, bias, out_shape, quant_folder, table)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The GEMV on ``[x (M, K) fp16]`` (quantised here) or ``[codes (M, K) int8, scales (M,)]``."""
        x, s = inputs[0], self.spec
        if not x.is_cuda or not self.wq.is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r} was compiled for CUDA; move the model and inputs to a GPU "
                                   "(compiled.to('cuda'))")
        if self._op is None or self._op.wq.data_ptr() != self.wq.data_ptr():
            self._op = W8A8GemvOp(self.folder, s, self.wq, self.weight_scale, self.bias,
                                  self.out_scale_os if self.out_scale is not None else None, self.table)
        if len(inputs) == 2:
            xq, xs = x.contiguous(), inputs[1]
        else:
            xh = x.contiguous()
            check_fp16_input(s.name, xh, s.m, s.k, act16_dtype(s))
            if self.quant_folder and self._quantizer is None:
                self._quantizer = RowQuantizer(self.quant_folder)
            xq, xs = (self._quantizer or quantize_rows)(xh)
        return [self._op(xq, xs)]

    def dense_weight(self) -> torch.Tensor:
        """The ``(N, K)`` fp16 weight the kernel applies (dequantised), on the CPU."""
        table = None if self.table is None else self.table.cpu()
        return (unpack_weight(self.spec, self.wq.cpu(), table).float() * self.weight_scale.cpu()[:, None]).to(
            act16_dtype(self.spec))

    # ---- saved models (sparta.saved) ------------------------------------------------
    def repack(self, graph, op_plan) -> None:
        """Quantise and pack the graph's weight again as the build does (the plan's int8 scales, ``from_weight``)."""
        from ...codegen.cuda_bind import gemm_parts
        from .spec import int8_weight_scale
        parts = gemm_parts(graph, graph.op(self.op_name), op_plan)
        weight = parts.site.weight
        fresh = W8A8GemvCUDA.from_weight(self.op_name, self.input_names[0], self.folder, self.spec, weight,
                                         int8_weight_scale(op_plan, weight, self.spec.k), parts.bias, self.out_shape)
        for name in self.weight_names:
            self._buffers[name] = fresh._buffers.get(name)
        self._op = None

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "x_name": self.input_names[0], "out_shape": list(self.out_shape),
                  "spec": dataclasses.asdict(self.spec), "kernel": folder.name, "weight_name": self.weight_name,
                  "weight_transposed": self.weight_transposed}
        inputs, folders = self.input_config()
        config.update(inputs)
        config.update(self.output_config())
        tensors = {"wq": self.wq, "weight_scale": self.weight_scale,
                   **({"bias": self.bias} if self.bias is not None else {}),
                   **({"table": self.table} if self.table is not None else {})}
        return config, tensors, {folder.name: folder, **folders}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> W8A8GemvCUDA:
        spec = W8A8GemvSpec(**config["spec"])
        folder = folders[config["kernel"]]
        check_saved_spec(config["op_name"], folder, spec)
        module = cls(config["op_name"], config["x_name"], folder, spec, tensors["wq"], tensors["weight_scale"],
                     tensors.get("bias"), tuple(config["out_shape"]),
                     folders[config["quantizer"]] if config.get("quantizer") else None, tensors.get("table"))
        module.weight_name, module.weight_transposed = config["weight_name"], config["weight_transposed"]
        module.restore_input(config)
        module.restore_output(config)
        return module

    def extra_repr(self) -> str:
        s = self.spec
        return (f"{self.op_name}: {s.k}->{s.n}, W8A8 GEMV{' (block-sparse)' if s.sparse else ''}, "
                f"{s.m or f'up to {s.rows}'} rows, act={s.act}"
                f"{f', int8 codes out (scale {self.out_scale:.3g})' if self.out_scale is not None else ''}")


__all__ = ["W8A8GemvCUDA", "W8A8GemvOp"]
