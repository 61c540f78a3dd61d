"""The CPU kernels' fused epilogue (activation after bias): a TIR expression builder and its torch reference."""

from __future__ import annotations

import torch

from . import fast_math

ACTIVATIONS = (None, "relu", "gelu", "silu", "tanh", "sigmoid")


def tir_activation(name: str | None, v):
    """The activation applied to TIR expression ``v`` (float32), in vector registers (``fast_math``: polynomial
    erf and exp, within ``fast_math.BOUNDS`` of the exact functions)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS}")
    return fast_math.tir_activation(name, v)


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
