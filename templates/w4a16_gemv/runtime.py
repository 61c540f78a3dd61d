"""A dense 4-bit linear on few rows running sparta's W4A16 GEMV kernel (``templates/w4a16_gemv/``), no TVM.

:class:`W4A16GemvCUDA` is the graph module ``compile(target="cuda")`` puts in place of a dense linear whose
weights calibration lowered to 4 bits when the op has at most 16 activation rows (decode): int4 codes
in the kernel's interleaved layout, fp16 group scales (and uint8 zero points), bias fused. It saves and
loads without TVM like :class:`~sparta.templates.bsr_linear.runtime.SparseLinearCUDA`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .spec import W4A16Spec, dequantize, pack_codes, split_buffers
from ...runtime.cuda import (CudaKernel, CudaRuntimeError, GraphWeightLayout, act16_dtype, check_fp16_input, check_saved_spec,
                   lanes16)
from ...runtime.ops import KernelModule


class W4A16GemvOp:
    """The kernel on device tensors: ``op(x)`` for 16-bit ``(M, K)`` rows (``spec.m``, or up to ``spec.rows`` for a
    kernel of any M); ``wq``, ``scale``, ``zero`` as :func:`pack_codes` returns them, ``bias`` or None; ``split``: the
    split-K workspace (``split_buffers``; made here if not given)."""

    def __init__(self, folder, spec: W4A16Spec, wq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 bias: torch.Tensor | None, split: dict | None = None):
        self.kernel, self.spec = CudaKernel(folder), spec
        self.wq, self.scale, self.zero, self.bias = wq, scale, zero, bias
        self.split = split_buffers(spec, wq.device) if split is None else split
        self._prepared = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        check_fp16_input(s.name, x, s.m, s.k, act16_dtype(s))
        if x.shape[0] > s.max_rows:
            raise CudaRuntimeError(f"{s.name}: the GEMV takes at most {s.max_rows} rows, got {x.shape[0]}")
        y = torch.empty(x.shape[0], s.n, dtype=x.dtype, device=x.device)
        if x.shape[0] == 0:            # no rows: nothing to launch
            return y
        if self._prepared is None:
            self._prepared = self.kernel.prepare(
                ("X", "Y"), X=lanes16(x), Wq=self.wq, S=lanes16(self.scale), Y=lanes16(y),
                **({} if s.sym else {"Z": self.zero}), **({"B": lanes16(self.bias)} if s.bias else {}), **self.split)
        else:
            self._prepared.launch(X=lanes16(x), Y=lanes16(y))
        return y


class W4A16GemvCUDA(GraphWeightLayout, KernelModule):
    """One graph op run by the W4A16 GEMV: ``y = x · dequant(W)ᵀ (+ b)`` for the op's ``(M, K)`` input, as the op
    ``sparta::w4a16_gemv`` (its split-K workspace stays inside the op)."""

    kernel_family = "w4a16_gemv"
    weight_names = ("wq", "scale", "zero", "bias")

    def __init__(self, op_name: str, x_name: str, folder, spec: W4A16Spec, wq: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None, bias: torch.Tensor | None, out_shape: tuple):
        super().__init__()
        if wq.shape != (spec.tiles, spec.chunks, 32, 4) or wq.dtype != torch.int32 \
                or scale.shape != (spec.tiles, spec.groups, 8) or (zero is None) != spec.sym:
            raise CudaRuntimeError(f"op {op_name!r}: packed weights {tuple(wq.shape)} / scales {tuple(scale.shape)} "
                                   f"do not fit {spec.name} (w4a16_gemv.spec.pack_codes)")
        if spec.bias and bias is None:
            raise CudaRuntimeError(f"op {op_name!r}: the kernel adds a bias; pass one")
        self.op_name, self.input_names, self.folder, self.spec = op_name, [x_name], str(folder), spec
        self.register_buffer("wq", wq)
        act = act16_dtype(spec)
        self.register_buffer("scale", scale.to(act))
        self.register_buffer("zero", zero)
        self.register_buffer("bias", bias.to(act) if bias is not None else None)
        for key, buf in split_buffers(spec, wq.device).items():     # split-K workspace: not saved
            self.register_buffer(f"split_{key}", buf, persistent=False)
        self.out_shape = tuple(out_shape)
        self.weight_name, self.weight_transposed = None, False
        self._op = None
        self.register_kernel(op_name)

    @classmethod
    def from_codes(cls, op_name: str, x_name: str, folder, spec: W4A16Spec, codes: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor | None, bias: torch.Tensor | None, out_shape: tuple) -> W4A16GemvCUDA:
        """From uint8 codes ``(N, K)`` (0..15) and per-group scales / zero points ``(N, K / group)``."""
        wq, s, z = pack_codes(codes, scale, zero, spec)
        return cls(op_name, x_name, folder, spec, wq, s, z, bias, out_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = self.call_kernel(x.reshape(-1, self.spec.k).to(act16_dtype(self.spec)).contiguous())
        return y.reshape(*x.shape[:-1], self.spec.n).to(x.dtype)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The GEMV on ``[x (M, K) fp16 or bf16]``: ``[(M, N)]`` of its type."""
        xh = inputs[0].contiguous()
        if not xh.is_cuda or not self.wq.is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r} was compiled for CUDA; move the model and inputs to a GPU "
                                   "(compiled.to('cuda'))")
        if self._op is None or self._op.wq.data_ptr() != self.wq.data_ptr():
            self._op = W4A16GemvOp(self.folder, self.spec, self.wq, self.scale, self.zero, self.bias,
                                   {"P": self.split_P, "C": self.split_C} if self.spec.ksplit > 1 else {})
        return [self._op(xh)]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [inputs[0].new_empty(inputs[0].shape[0], self.spec.n, dtype=act16_dtype(self.spec))]

    def dense_weight(self) -> torch.Tensor:
        """The ``(N, K)`` fp16 weight the kernel applies (dequantised), on the CPU."""
        z = None if self.zero is None else self.zero.cpu()
        return dequantize(self.wq.cpu(), self.scale.cpu(), z, self.spec).to(act16_dtype(self.spec))

    # ---- saved models (sparta.saved) ------------------------------------------------
    def repack(self, graph, op_plan) -> None:
        """Quantise and pack the graph's weight again as the build does (the plan's 4-bit scales, ``from_codes``)."""
        from ...codegen.cuda_bind import gemm_parts
        from .spec import w4_codes
        parts = gemm_parts(graph, graph.op(self.op_name), op_plan)
        weight, group = parts.site.weight, self.spec.group
        params = op_plan.weight_quant[4].params(weight)
        scale_el, zero_el = params.expand(self.spec.k)
        zero = None if params.zero is None else zero_el[:, ::group].to(torch.uint8)
        fresh = W4A16GemvCUDA.from_codes(self.op_name, self.input_names[0], self.folder, self.spec,
                                         w4_codes(params, weight), scale_el[:, ::group], zero, parts.bias,
                                         self.out_shape)
        for name in self.weight_names:
            self._buffers[name] = fresh._buffers.get(name)
        self._op = None

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "x_name": self.input_names[0], "out_shape": list(self.out_shape),
                  "spec": dataclasses.asdict(self.spec), "kernel": folder.name, "weight_name": self.weight_name,
                  "weight_transposed": self.weight_transposed}
        tensors = {"wq": self.wq, "scale": self.scale, **({"zero": self.zero} if self.zero is not None else {}),
                   **({"bias": self.bias} if self.bias is not None else {})}
        return config, tensors, {folder.name: folder}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> W4A16GemvCUDA:
        spec = W4A16Spec(**config["spec"])
        folder = folders[config["kernel"]]
        check_saved_spec(config["op_name"], folder, spec)
        module = cls(config["op_name"], config["x_name"], folder, spec, tensors["wq"], tensors["scale"],
                     tensors.get("zero"), tensors.get("bias"), tuple(config["out_shape"]))
        module.weight_name, module.weight_transposed = config["weight_name"], config["weight_transposed"]
        return module

    def extra_repr(self) -> str:
        s = self.spec
        return f"{self.op_name}: {s.k}->{s.n}, W4A16 GEMV, {s.m or f'up to {s.rows}'} rows, group {s.group}{'' if s.sym else ', zero points'}"


__all__ = ["W4A16GemvCUDA", "W4A16GemvOp"]
