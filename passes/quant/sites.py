"""Where calibration applies: ops whose output channels each read one weight row, the
calibration batches, and the calibrated weights as the kernels apply them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import QuantizationError, SpartaError
from ...graph import Graph

CONV_OPS = ("conv1d", "conv2d", "conv3d")

@dataclass(frozen=True)
class WeightSite:
    op: str
    x: str                 # the activation input
    weight: str
    layout: str            # "nk" (linear, conv: channels first) or "kn" (mm/addmm/matmul: (K, N))
    gemm: bool             # output channel is the last dim and the op is x2d @ Wᵀ (+ bias)

    def to_nk(self, w: torch.Tensor) -> torch.Tensor:
        return w.t() if self.layout == "kn" else w.reshape(w.shape[0], -1)

    def from_nk(self, w_nk: torch.Tensor, shape) -> torch.Tensor:
        return w_nk.t() if self.layout == "kn" else w_nk.reshape(shape)


def weight_sites(graph: Graph) -> dict[str, WeightSite]:
    """Ops with a floating-point weight whose output channels each read one weight row, by op name."""
    from ..gemm import gemm_view

    def float_weight(name):
        v = graph.tensor(name) if name else None
        return v is not None and v.kind == "weight" and v.data is not None and v.data.dtype.is_floating_point

    sites = {}
    for op in graph.ops():
        if op.op in CONV_OPS and float_weight(op.input_of("weight")) and op.input_of("input"):
            sites[op.name] = WeightSite(op.name, op.input_of("input"), op.input_of("weight"), "nk", False)
        elif op.op in ("linear", "addmm", "mm", "matmul"):
            view = gemm_view(graph, op)
            if view is not None and float_weight(view[1]):
                sites[op.name] = WeightSite(op.name, view[0], view[1], "nk" if op.op == "linear" else "kn", True)
    return sites


def parse_batches(graph: Graph, calibration) -> list[list[torch.Tensor]]:
    """The calibration batches as flat input lists: each batch a tensor, a tuple of positional
    inputs or a dict of keyword inputs (a callable returning such an iterable also works)."""
    if callable(calibration):
        calibration = calibration()
    if isinstance(calibration, (torch.Tensor, dict)):
        raise QuantizationError("calibration must be an iterable of batches (e.g. a list of input tuples), "
                                f"not a single {type(calibration).__name__}")
    try:
        items = list(calibration)
    except TypeError:
        raise QuantizationError(f"calibration must be an iterable of batches, got {type(calibration).__name__}") \
            from None
    if not items:
        raise QuantizationError("calibration holds no batches")
    out = []
    for i, b in enumerate(items):
        args, kwargs = ((), b) if isinstance(b, dict) else ((b,) if isinstance(b, torch.Tensor) else tuple(b), {})
        try:
            out.append(graph.flat_inputs(args, kwargs))
        except SpartaError as e:
            raise QuantizationError(f"calibration batch {i}: {e}") from None
    return out


def fake_quantized_weights(graph: Graph) -> dict[str, torch.Tensor]:
    """The calibrated weights as the kernels apply them (dequantised), by parameter name: the last calibration
    report's fitted scales (``graph.quantization.weights``) applied to the masked weights."""
    report = graph.quantization
    fitted = getattr(report, "weights", {}) or {}
    out = {}
    for site in weight_sites(graph).values():
        quant = fitted.get(site.weight)
        if quant is None:
            continue
        v = graph.tensor(site.weight)
        w = v.tesa.apply(v.data)
        w_nk = site.to_nk(w).float()
        out[site.weight] = site.from_nk(quant.params(w_nk).dequantize(w_nk), w.shape).to(w.dtype)
    return out