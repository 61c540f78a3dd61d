"""sparta's per-token int8 quantiser from torch, and the int8 input and output sides the W8A8 graph modules share
(no TVM needed).

:class:`RowQuantizer` runs the quantiser kernel (``templates/quant/``): ``q(x) -> (xq, xs)``, bit for bit
``quant.spec.quantize_rows``, one pass over ``x``. :class:`QuantizedInput` and :class:`RequantizedOutput` are the
mixins of :class:`~sparta.templates.bsr_linear.runtime.SparseLinearCUDA` and :class:`~sparta.templates.w8a8_gemv.runtime.W8A8GemvCUDA`:
an input that arrives as int8 codes and scales, an output returned as int8 codes at a static scale;
:class:`QuantizedLinear` is both, with the call they share.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..epilogue_ref import out_scale_arg
from .spec import QuantRowsSpec
from ...runtime.cuda import CudaKernel, CudaRuntimeError, act16_dtype, check_fp16_input, kernel_file, lanes16


def output_scale_arg(out_scale, device) -> torch.Tensor:
    """The ``OS`` argument of an ``out="int8"`` kernel on ``device``, from the scale or from that argument already
    made (a module's buffer: nothing is allocated while a CUDA graph is recorded)."""
    if isinstance(out_scale, torch.Tensor):
        if out_scale.shape != (2,) or out_scale.dtype != torch.float32:
            raise CudaRuntimeError("an out='int8' kernel's OS argument is fp32 [scale, 1 / scale]")
        return out_scale.to(device)
    return out_scale_arg(out_scale).to(device)


class RowQuantizer:
    """sparta's per-row int8 quantisation kernel (``templates/quant/``): ``q(x) -> (xq, xs)``,
    bit for bit ``quant.spec.quantize_rows``, one pass over ``x``."""

    def __init__(self, folder):
        self.kernel = CudaKernel(folder)
        m, self.k = next(a["shape"] for a in self.kernel.launch["args"] if a["name"] == "X")
        self.m = m if type(m) is int else 0      # 0: a kernel for any number of rows
        spec = json.loads(kernel_file(folder, "spec.json")) if (Path(folder) / "spec.json").is_file() else None
        self.dtype = act16_dtype(QuantRowsSpec(**spec)) if spec else torch.float16
        self._prepared = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_fp16_input(self.kernel.name, x, self.m, self.k, self.dtype)
        xq = torch.empty(x.shape[0], self.k, dtype=torch.int8, device=x.device)
        xs = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        if self._prepared is None:
            self._prepared = self.kernel.prepare(("X", "XQ", "XS"), X=lanes16(x), XQ=xq, XS=xs)
        else:
            self._prepared.launch(X=lanes16(x), XQ=xq, XS=xs)
        return xq, xs


class QuantizedInput:
    """The input side of a W8A8 graph module: fp16 activations quantised per token on the way in (the kernel in
    ``quant_folder``; torch ops without one), or, after :meth:`use_quantized_input`, the (codes, scales) graph
    tensors a LayerNorm kernel or a requantising linear wrote. Needs ``op_name``, ``input_names`` and
    ``quant_folder``; sets ``out_dtype`` (the output's dtype when the input is no float tensor to copy it from)."""

    def use_quantized_input(self, names: list[str], out_dtype: torch.dtype) -> None:
        """Read per-token int8 codes and fp32 scales (the graph tensors ``names``, e.g. from a LayerNorm
        kernel that quantises its output) instead of quantising a float input; return ``out_dtype``."""
        if not self.reads_int8 or len(names) != 2:
            raise CudaRuntimeError(f"op {self.op_name!r}: only a W8A8 kernel reads (codes, scales) inputs")
        self.input_names, self.out_dtype, self.quant_folder = list(names), out_dtype, None

    def input_config(self) -> tuple[dict, dict[str, Path]]:
        """What a save records of the input side: (config entries, kernel folders)."""
        config, folders = {}, {}
        if self.quant_folder:
            config["quantizer"] = Path(self.quant_folder).name
            folders[config["quantizer"]] = Path(self.quant_folder)
        if self.out_dtype is not None:
            config["quantized_input"] = {"names": self.input_names, "dtype": str(self.out_dtype).split(".")[-1]}
        return config, folders

    def restore_input(self, config: dict) -> None:
        """The input side of a loaded module, from its :meth:`input_config` entries."""
        quantized = config.get("quantized_input")
        if quantized is not None:
            dtype = getattr(torch, quantized["dtype"], None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise CudaRuntimeError(f"op {config['op_name']!r}: unknown output dtype {quantized['dtype']!r}")
            self.use_quantized_input(quantized["names"], dtype)


class RequantizedOutput:
    """The output side of a W8A8 graph module that may return the int8 codes of its output at one static scale, and
    that scale per row, as the graph tensors ``output_names`` (what the W8A8 linears reading it take)."""

    def _requantized(self, names: list[str], scale: float, rows: int, device) -> None:
        if len(names) != 2:
            raise CudaRuntimeError(f"op {self.op_name!r}: requantising names two tensors (codes, scales)")
        out_scale_arg(scale)                             # refuses a scale that is not positive and finite
        self.output_names, self.out_scale, self._op = list(names), float(scale), None
        self.scale_rows = rows      # 0: any number of rows (the one scale expanded to the call's)
        self.register_buffer("code_scale", torch.full((rows or 1,), float(scale), dtype=torch.float32, device=device))
        self.register_buffer("out_scale_os", out_scale_arg(scale).to(device), persistent=False)

    def output_config(self) -> dict:
        """What a save records of the output side (restored by :meth:`restore_output`)."""
        if self.out_scale is None:
            return {}
        return {"requantized_output": {"names": self.output_names, "scale": self.out_scale}}

    def restore_output(self, config: dict) -> None:
        """The output side of a loaded module, from its :meth:`output_config` entries (the kernels it was saved with
        already write codes)."""
        requantized = config.get("requantized_output")
        if requantized is not None:
            self.requantize_output(requantized["names"], requantized["scale"])


class QuantizedLinear(QuantizedInput, RequantizedOutput):
    """A CUDA linear graph module with both sides (``spec.k``, ``spec.n``, ``spec.out``; its kernel op run by
    ``call_kernel``): its call is torch ops around the op, and the op's fake outputs follow the input's rows."""

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        if (x_scale is not None) != (self.out_dtype is not None):
            raise CudaRuntimeError(f"op {self.op_name!r} takes {'(codes, scales)' if self.out_dtype else 'one input'}")
        s = self.spec
        if x_scale is not None:
            (y,) = self.call_kernel(x.reshape(-1, s.k), x_scale.reshape(-1))
        else:
            (y,) = self.call_kernel(x.reshape(-1, s.k).to(act16_dtype(s)).contiguous())
        rows = y.shape[0]
        y = y.reshape(*x.shape[:-1], s.n)
        if self.out_scale is not None:
            return y, self.code_scale if self.scale_rows else self.code_scale.expand(rows)
        return y.to(self.out_dtype or x.dtype)

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        dtype = torch.int8 if self.spec.out == "int8" else act16_dtype(self.spec)
        return [inputs[0].new_empty(inputs[0].shape[0], self.spec.n, dtype=dtype)]


__all__ = ["QuantizedInput", "QuantizedLinear", "RequantizedOutput", "RowQuantizer"]
