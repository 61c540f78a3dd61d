"""The packing of a CPU linear's weight into its sub-kernels' arguments (TVM-free), shared by the build and by a
saved model loaded with the user's checkpoint (``sparta.load(path, weights=...)``)."""

from __future__ import annotations

import math

import torch

from ...errors import CodegenError
from ...passes.gemm import gemm_bias, in_weight_layout
from . import block_spec, fine_spec


def op_bias(graph, op, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(bias, extra_bias)``: the op's kept (N,) bias in fp32, or its addend of another shape (addmm's (M, N))."""
    name = gemm_bias(op)
    bias = graph.tensor(name).data if name else None
    if bias is not None and bias.shape != (n,):
        return None, bias
    return (graph.tesa(name).apply(bias.to(torch.float32)) if bias is not None else None), None


def sub_weight(weight: torch.Tensor, sub, n: int, k: int, n_pad: int, k_pad: int) -> torch.Tensor:
    """The (N_pad, K_pad) share of ``weight`` (N, K) a sub-operator computes (its elements; zero elsewhere)."""
    w = torch.where(sub.elements.mask.reshape(n, k).to(weight.device), weight, 0.0)   # (a meta weight: meta)
    return torch.nn.functional.pad(w, (0, k_pad - k, 0, n_pad - n))


def pack_sub(op_plan, weight: torch.Tensor, sub, template, spec, n: int, k: int, n_pad: int,
             k_pad: int) -> dict[str, torch.Tensor]:
    """A sub-kernel's packed arguments from the op's (N, K) weight (quantised widths at the plan's scales)."""
    w = sub_weight(weight, sub, n, k, n_pad, k_pad)
    if template is fine_spec:
        return fine_spec.pack(spec, w)
    scale, zero, _ = fitted_scales(op_plan, weight, sub.weight_bits, (n_pad, k_pad), spec.block[1])
    return block_spec.pack(spec, w, scale, zero)


def fitted_scales(op_plan, weight: torch.Tensor, bits: int, padded: tuple[int, int], block_width: int):
    """Element-wise scale and zero point of the plan's quantisation of ``weight`` (N, K) at ``bits``, padded
    to the kernel's shape, and the kernel's scale group (None, None, 0 for a float width)."""
    if bits not in (8, 4):
        return None, None, 0
    quant = op_plan.weight_quant.get(bits)
    if quant is None:
        raise CodegenError(f"op {op_plan.op!r}: the plan runs {bits}-bit weights but holds no scales for them "
                           "(OpPlan.weight_quant; transform fills it)")
    k = weight.shape[1]
    params = quant.params(weight if weight.is_meta else torch.where(op_plan.kept(*weight.shape), weight, 0.0))

    def pad(t):  # padded columns repeat the last one (per-channel scales stay per channel); rows get ones
        if t is None:
            return None
        t = torch.cat([t, t[:, -1:].expand(-1, padded[1] - k)], 1)
        return torch.cat([t, torch.ones(padded[0] - t.shape[0], padded[1], device=t.device)], 0)

    scale, zero = params.expand(k)
    group = math.gcd(params.group, block_width) if params.group < k else block_width
    return pad(scale), pad(zero), (0 if group == block_width else group)


def effective_weight(graph, op, subs, n: int, k: int) -> torch.Tensor | None:
    """The weight the kernels really apply (quantised sub-ops dequantised), in the graph's layout (None: fp32)."""
    if all(getattr(s.spec, "weight_bits", 32) == 32 for s in subs):
        return None
    if any(t.is_meta for s in subs for t in s.packed.values()):     # a meta-device model: the shape only
        return in_weight_layout(graph, op, torch.empty(n, k, device="meta"))
    total = torch.zeros(n, k)
    for s in subs:
        if s.template is block_spec:
            total += block_spec.dequantized_weight(s.spec, s.packed)[:n, :k]
        else:
            total += fine_spec.dense_weight(s.spec, s.packed)[:n, :k]
    return in_weight_layout(graph, op, total)
