"""sparta's norm kernels (``templates/norm/``: LayerNorm, RMSNorm) from torch, without TVM.

``LayerNormOp(folder, spec, weight, bias)(x)`` normalises a contiguous fp16 ``(M, N)`` tensor and returns
what the kernel was built to emit, in this order: ``y`` (unless ``out="int8"``), ``h = x + residual``
(``residual_out``), ``xq, xs`` (per-token int8 codes and fp32 scales, what the W8A8 linears read).
:class:`LayerNormCUDA` is the graph module ``compile(target="cuda")`` puts in place of a ``layer_norm`` op whose
output feeds W8A8 linears: it hands them the quantised activations (graph tensors ``<out>:int8`` and ``<out>:scale``)
so they skip their own quantisation pass, and gives the fp16 output to every other reader.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from .spec import LayerNormSpec
from ...runtime.cuda import CudaKernel, CudaRuntimeError, act16_dtype, check_fp16_input, check_saved_spec, lanes16
from ...runtime.ops import KernelModule

QUANT_SUFFIXES = (":int8", ":scale")


def quantized_names(tensor: str) -> list[str]:
    """Graph names of the per-token int8 codes and scales of ``tensor``."""
    return [tensor + s for s in QUANT_SUFFIXES]


def norm_params(graph, op) -> dict[str, torch.Tensor | None]:
    """The norm op's kept weight and bias in fp32 (None where it has none), as its kernel module takes them."""
    params = {}
    for role in ("weight", "bias"):
        name = op.input_of(role)
        params[role] = None if name is None else graph.tesa(name).apply(graph.tensor(name).data.float())
    return params


class LayerNormOp:
    """One LayerNorm kernel with its (fp16) weight and bias on the GPU."""

    def __init__(self, folder, spec: LayerNormSpec, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        self.kernel, self.spec = CudaKernel(folder), spec
        for what, t, want in (("weight", weight, spec.affine), ("bias", bias, spec.bias)):
            if want != (t is not None):
                raise CudaRuntimeError(f"{spec.name}: the kernel {'takes' if want else 'has no'} a {what}")
            if t is not None and tuple(t.shape) != (spec.n,):
                raise CudaRuntimeError(f"{spec.name}: {what} is {tuple(t.shape)}, the kernel wants ({spec.n},)")
        self.act = act16_dtype(spec)
        self.weight = None if weight is None else weight.detach().to(self.act).contiguous()
        self.bias = None if bias is None else bias.detach().to(self.act).contiguous()
        self._prepared = None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        s = self.spec
        check_fp16_input(s.name, x, s.m, s.n, self.act)
        if s.residual != (residual is not None):
            raise CudaRuntimeError(f"{s.name}: the kernel {'adds' if s.residual else 'takes no'} a residual")
        res = {}
        if residual is not None:
            check_fp16_input(s.name, residual, x.shape[0], s.n, self.act)
            res["R"] = lanes16(residual)
        if self.weight is not None and self.weight.device != x.device:
            self.weight = self.weight.to(x.device)
            self.bias = None if self.bias is None else self.bias.to(x.device)
            self._prepared = None
        outs, m = {}, x.shape[0]
        if s.out != "int8":
            outs["Y"] = torch.empty(m, s.n, dtype=self.act, device=x.device)
        if s.residual_out:
            outs["H"] = torch.empty(m, s.n, dtype=self.act, device=x.device)
        if s.out != "fp16":
            outs["XQ"] = torch.empty(m, s.n, dtype=torch.int8, device=x.device)
            outs["XS"] = torch.empty(m, dtype=torch.float32, device=x.device)
        lanes = {k: lanes16(v) for k, v in outs.items()}                 # bf16 as 16-bit lanes
        if self._prepared is None:
            params = {k: lanes16(v) for k, v in (("G", self.weight), ("B", self.bias)) if v is not None}
            self._prepared = self.kernel.prepare(("X", *res, *outs), X=lanes16(x), **res, **params, **lanes)
        else:
            self._prepared.launch(X=lanes16(x), **res, **lanes)
        vals = tuple(outs.values())
        return vals[0] if len(vals) == 1 else vals


class LayerNormCUDA(KernelModule):
    """A ``layer_norm`` op run by sparta's kernel (the op ``sparta::norm``); ``output_names`` are the
    graph tensors it returns, in order: its output (if anything but the W8A8 linears reads it) and/or
    ``quantized_names(output)``. With ``residual_name`` (``spec.residual``) it normalises ``x + residual``: the add
    that fed it, fused."""

    kernel_family = "norm"
    weight_names = ("weight", "bias")

    def __init__(self, op_name: str, x_name: str, output_names: list[str], folder, spec: LayerNormSpec,
                 weight: torch.Tensor | None, bias: torch.Tensor | None, out_shape: tuple,
                 residual_name: str | None = None):
        super().__init__()
        want = (["y"] if spec.out != "int8" else []) + ["h"] * spec.residual_out + \
            (["q", "s"] if spec.out != "fp16" else [])
        if len(output_names) != len(want):
            raise CudaRuntimeError(f"op {op_name!r}: a kernel emitting {spec.out} returns {len(want)} tensors, "
                                   f"not {len(output_names)}")
        if out_shape[-1] != spec.n or (spec.m and math.prod(out_shape) != spec.m * spec.n):
            raise CudaRuntimeError(f"op {op_name!r}: output shape {tuple(out_shape)} is not {spec.m} rows of {spec.n}")
        if spec.residual != (residual_name is not None):
            raise CudaRuntimeError(f"op {op_name!r}: the kernel {'adds' if spec.residual else 'takes no'} a residual")
        self.op_name, self.output_names = op_name, list(output_names)
        self.input_names = [x_name] + ([residual_name] if residual_name is not None else [])
        self.folder, self.spec, self.out_shape = str(folder), spec, tuple(out_shape)
        act = act16_dtype(spec)
        self.register_buffer("weight", None if weight is None else weight.detach().to(act))
        self.register_buffer("bias", None if bias is None else bias.detach().to(act))
        self._op = None
        self.register_kernel(op_name)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        n = self.spec.n
        act = act16_dtype(self.spec)
        inputs = [x.reshape(-1, n).to(act).contiguous()]
        if residual is not None:
            inputs.append(residual.reshape(-1, n).to(act).contiguous())
        outs = self.call_kernel(*inputs)
        sixteen = (self.spec.out != "int8") + self.spec.residual_out      # y and h: the input's shape and dtype
        outs = [o.reshape(x.shape).to(x.dtype) for o in outs[:sixteen]] + list(outs[sixteen:])
        if self.spec.out != "fp16":     # the codes keep the input's leading dims: the linears reading them take theirs
            outs = [*outs[:-2], outs[-2].reshape(x.shape), outs[-1]]
        return tuple(outs) if len(outs) > 1 else outs[0]

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The kernel on ``[x (M, N) fp16]`` (and the residual): what its spec emits, of ``y``, codes, scales."""
        if not inputs[0].is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r} was compiled for CUDA; move the model and inputs to a GPU "
                                   "(compiled.to('cuda'))")
        if self._op is None or (self.weight is not None and self._op.weight.data_ptr() != self.weight.data_ptr()):
            self._op = LayerNormOp(self.folder, self.spec, self.weight, self.bias)
        outs = self._op(*(t.contiguous() for t in inputs))
        return list(outs) if isinstance(outs, tuple) else [outs]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        x, out = inputs[0], self.spec.out
        return ([x.new_empty(x.shape)] if out != "int8" else []) + [x.new_empty(x.shape)] * self.spec.residual_out + \
            ([x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[0], dtype=torch.float32)]
             if out != "fp16" else [])

    def repack(self, graph, op_plan=None) -> None:
        """The graph's weight and bias again, as the build takes them (:func:`norm_params`)."""
        act = act16_dtype(self.spec)
        for role, t in norm_params(graph, graph.op(self.op_name)).items():
            if (t is None) != (self._buffers[role] is None):
                raise CudaRuntimeError(f"op {self.op_name!r}: the checkpoint's norm {role} does not fit the kernel")
            self._buffers[role] = None if t is None else t.to(act)
        self._op = None

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "x_name": self.input_names[0], "output_names": self.output_names,
                  "spec": dataclasses.asdict(self.spec), "kernel": folder.name, "out_shape": list(self.out_shape),
                  "residual_name": self.input_names[1] if self.spec.residual else None}
        tensors = {k: v for k, v in (("weight", self.weight), ("bias", self.bias)) if v is not None}
        return config, tensors, {folder.name: folder}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> LayerNormCUDA:
        spec = LayerNormSpec(**config["spec"])
        folder = folders[config["kernel"]]
        check_saved_spec(config["op_name"], folder, spec)
        return cls(config["op_name"], config["x_name"], config["output_names"], folder, spec,
                   tensors.get("weight"), tensors.get("bias"), tuple(config["out_shape"]), config.get("residual_name"))

    def extra_repr(self) -> str:
        s = self.spec
        return f"{self.op_name}: {s.kind} {s.m or 'M'}x{s.n}{' + residual' if s.residual else ''}, emits {s.out}" + \
            (" and the sum" if s.residual_out else "")


__all__ = ["LayerNormCUDA", "LayerNormOp", "quantized_names", "QUANT_SUFFIXES"]
