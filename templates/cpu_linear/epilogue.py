"""The CPU kernels' fused epilogue (activation after bias): a TIR expression builder and its torch reference."""

from __future__ import annotations

import math

import torch

ACTIVATIONS = (None, "relu", "gelu", "silu", "tanh", "sigmoid")


def tir_activation(name: str | None, v):
    """The activation applied to TIR expression ``v`` (float32)."""
    from tvm import tirx
    if name is None:
        return v
    if name == "relu":
        return tirx.max(v, tirx.const(0.0, "float32"))
    if name == "gelu":  # exact (erf) GELU, as torch's default
        return v * tirx.const(0.5, "float32") * (tirx.const(1.0, "float32") +
                                                 tirx.erf(v * tirx.const(1 / math.sqrt(2.0), "float32")))
    if name == "silu":
        return v / (tirx.const(1.0, "float32") + tirx.exp(-v))
    if name == "tanh":
        return tirx.tanh(v)
    if name == "sigmoid":
        return tirx.const(1.0, "float32") / (tirx.const(1.0, "float32") + tirx.exp(-v))
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}")


def torch_activation(name: str | None, y: torch.Tensor) -> torch.Tensor:
    if name is None:
        return y
    return {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
            "tanh": torch.tanh, "sigmoid": torch.sigmoid}[name](y)


def torch_epilogue(spec, out: torch.Tensor, bias=None, y=None) -> torch.Tensor:
    """The CPU kernels' epilogue on an fp64 product: accumulate into ``y``, add the bias, activate."""
    if spec.accumulate:
        out = out + y.double()
    if spec.bias:
        out = out + bias.double()
    return torch_activation(spec.activation, out.float())
