"""The CPU int8 linear: a dense W8A8 GEMM on oneDNN's u8·s8 kernel (through ``torch.ops.onednn``).

``y = (codes(x) · Wqᵀ) · s_x[m] · s_w[n] + b``: the activation quantised per token to symmetric int8 codes
(``templates/quant/spec.quantize_rows``, the rule every W8A8 path shares), handed to oneDNN as ``uint8`` with a zero
point of 128 (the code's sign bit flipped), and the per-token scale applied after the GEMM (oneDNN takes one scale
per tensor, so it sees 1.0). The weight codes are packed once into oneDNN's blocked layout.

x86 without VNNI multiplies u8·s8 pairs into saturating int16 (``vpmaddubsw``): with the activation's full 8 bits the
weight codes must keep 7 (``|q| ≤ 63``) for the sums to be exact. :func:`host_code_bits` says which this CPU needs;
the module refuses codes wider than that.
"""

from __future__ import annotations

import functools
import math

import torch

from ...errors import CodegenError
from ..quant.spec import quantize_rows
from ...runtime.ops import KernelModule

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where the system does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
        return frozenset(line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        return frozenset()


def host_code_bits() -> int:
    """The widest weight codes oneDNN's int8 GEMM sums exactly on this CPU (7 on x86 without VNNI)."""
    flags = cpu_flags()
    return 7 if flags and "avx2" in flags and not flags & set(VNNI_FLAGS) else 8


def available() -> bool:
    """Whether torch here has oneDNN's int8 linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def int8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """What the kernel computes, in fp32 torch ops: per-token codes of ``x`` (M, K) against ``codes`` (N, K)."""
    q, s = quantize_rows(x.float())
    y = (q.double() @ codes.double().t()).float() * s[:, None] * scale[None, :]
    return y + bias if bias is not None else y


def int8_operands(graph, op, op_plan):
    """``(codes, scale, bias)`` of a dense W8A8 op: the kept weight's int8 codes at the plan's symmetric scales
    (one a row) and its kept fp32 bias, as :class:`Int8LinearCPU` takes them."""
    from ...passes.gemm import gemm_bias, gemm_view, weight_matrix
    n, k = gemm_view(graph, op)[4:]
    weight = torch.where(op_plan.kept(n, k), weight_matrix(graph, op), 0.0)
    params = op_plan.weight_quant[8].params(weight)
    scale = params.expand(k)[0][:, 0].contiguous()       # symmetric per channel (or tensor): one scale a row
    codes = params.codes(weight).to(torch.int8)
    bias_name = gemm_bias(op)
    bias = graph.tesa(bias_name).apply(graph.tensor(bias_name).data.to(torch.float32)) if bias_name else None
    return codes, scale, bias


class Int8LinearCPU(KernelModule):
    """``y = x · (codes · scale)ᵀ + b`` with ``x`` quantised per token (see the module docstring): oneDNN's GEMM
    runs as the op ``sparta::onednn_int8`` (its packed weight is no tensor a trace could hold), the quantiser and
    the scales around it as torch ops."""

    kernel_family = "onednn_int8"
    weight_names = ("scale", "zero_points")

    def __init__(self, op_name: str, input_name: str, codes: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, out_shape: tuple[int, ...], code_bits: int):
        super().__init__()
        if not available():
            raise CodegenError("torch here has no oneDNN int8 linear (torch.ops.onednn.qlinear_pointwise)")
        top = 2 ** (code_bits - 1) - 1
        if codes.dtype != torch.int8 or codes.dim() != 2 or int(codes.abs().max()) > top:
            raise CodegenError(f"op {op_name!r}: int8 weight codes must be an (N, K) int8 tensor within ±{top}")
        if code_bits > host_code_bits():
            raise CodegenError(f"op {op_name!r}: {code_bits}-bit weight codes overflow this CPU's int8 GEMM "
                               f"(x86 without VNNI sums exactly only {host_code_bits()}-bit codes); plan with "
                               "this machine's profile")
        self.op_name, self.input_names = op_name, [input_name]
        self.n, self.k = codes.shape
        self.code_bits = code_bits
        self.out_shape = tuple(out_shape)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous(), persistent=False)
        self.register_buffer("zero_points", torch.zeros(self.n, dtype=torch.long), persistent=False)
        self.packed = torch.ops.onednn.qlinear_prepack(codes, None)
        self.register_kernel(op_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(math.prod(x.shape[:-1]), self.k)
        q, s = quantize_rows(x2)
        u = q.view(torch.uint8).bitwise_xor(0x80)          # code c as the byte c + 128
        (y,) = self.call_kernel(u)
        y = torch.addcmul(self.bias, y, s[:, None]) if self.bias is not None else y * s[:, None]
        return y.reshape(*x.shape[:-1], self.n).to(x.dtype)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """oneDNN's GEMM of ``[codes + 128 (M, K) uint8]`` against the packed weight: ``[(M, N) fp32]``, before the
        per-token scale."""
        return [torch.ops.onednn.qlinear_pointwise(inputs[0].contiguous(), 1.0, 128, self.packed, self.scale,
                                                   self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [inputs[0].new_empty(inputs[0].shape[0], self.n, dtype=torch.float32)]

    def graph_weight_nk(self) -> torch.Tensor:
        """The (N, K) weight the kernel applies."""
        return self.codes.float() * self.scale[:, None]

    # ---- saved models (sparta.saved): nothing native, the codes are packed again on load --------------
    def repack(self, graph, op_plan) -> None:
        """Quantise the graph's weight again as the build does (:func:`int8_operands`) and pack it for oneDNN."""
        from ...passes.gemm import in_weight_layout
        op = graph.op(self.op_name)
        fresh = Int8LinearCPU(self.op_name, self.input_names[0], *int8_operands(graph, op, op_plan), self.out_shape,
                              self.code_bits)
        self.codes, self.scale, self.bias, self.packed = fresh.codes, fresh.scale, fresh.bias, fresh.packed
        self.reference_weight = in_weight_layout(graph, op, self.graph_weight_nk())

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict]:
        config = {"op_name": self.op_name, "input_name": self.input_names[0], "out_shape": list(self.out_shape),
                  "code_bits": self.code_bits}
        tensors = {"codes": self.codes, "scale": self.scale}
        if self.bias is not None:
            tensors["bias"] = self.bias
        return config, tensors, {}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict) -> Int8LinearCPU:
        codes, scale, bias = tensors["codes"], tensors["scale"], tensors.get("bias")
        n = codes.shape[0] if codes.dim() == 2 else -1
        if scale.shape != (n,) or (bias is not None and bias.shape != (n,)) or config["code_bits"] not in (7, 8):
            raise ValueError("saved int8 linear: codes, scale and bias shapes disagree")
        return cls(config["op_name"], config["input_name"], codes, scale, bias, tuple(config["out_shape"]),
                   int(config["code_bits"]))

    def extra_repr(self) -> str:
        return f"{self.op_name}: {self.k}->{self.n}, onednn int8 ({self.code_bits}-bit weight codes)"


__all__ = ["Int8LinearCPU", "int8_reference", "host_code_bits", "available", "cpu_flags"]
