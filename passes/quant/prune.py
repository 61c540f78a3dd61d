"""Pruning beside quantization in one calibration walk (a joint plan): a weight's blocks kept by magnitude, and what a
(density, bits) choice is estimated to cost: ``price(graph, op, weight, tesa, profile)``, given by the caller (the
plan's own estimate of the op with that TeSA, ``passes/transform/price.py``: this package imports nothing of the planner).

``QuantConfig.densities`` asks calibration to try, for each GEMM weight, keeping only the largest ``density`` of its
``prune_block`` blocks (by L2 norm, already pruned elements counting as zeros) at each width it tries; of the choices
whose added output error stays within the tolerance it keeps the one the plan estimates cheapest over the token range
it plans for (ties: the more blocks, then the more bits). A first heuristic: one op at a time in the walk's order, each op's
budget the same ``tolerance``, the model's outputs checked afterwards by ``model_tolerance`` as for bits alone.
"""

from __future__ import annotations

import math

import torch

from ...errors import QuantizationError
from ...tesa import TeSA
from .scheme import fake_quant_float


def check_densities(densities, block) -> tuple[tuple[float, ...], tuple[int, int]]:
    """``densities`` as a sorted tuple of fractions in (0, 1) and ``block`` as two positive ints, or a clear error."""
    try:
        ds = tuple(sorted({float(d) for d in densities}, reverse=True))
    except (TypeError, ValueError):
        raise QuantizationError(f"densities must be fractions of blocks to keep, e.g. (0.5, 0.25), got "
                                f"{densities!r}") from None
    if any(not (0.0 < d < 1.0) or not math.isfinite(d) for d in ds):
        raise QuantizationError(f"densities must lie strictly between 0 and 1, got {densities!r}")
    if not (isinstance(block, (tuple, list)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise QuantizationError(f"prune_block must be two positive ints, got {block!r}")
    return ds, (int(block[0]), int(block[1]))


def block_magnitude_mask(w_nk: torch.Tensor, density: float, block: tuple[int, int]) -> torch.Tensor:
    """Bool (N, K): the ``ceil(density · blocks)`` aligned ``block``-shaped blocks of ``w_nk`` with the largest L2 norm
    (edge blocks count what lies inside; ties go to the earlier block), every element of them."""
    n, k = w_nk.shape
    bh, bw = block
    gh, gw = -(-n // bh), -(-k // bw)
    padded = torch.zeros(gh * bh, gw * bw, dtype=torch.float64, device=w_nk.device)
    padded[:n, :k] = w_nk.double()
    norms = padded.pow(2).reshape(gh, bh, gw, bw).sum((1, 3)).reshape(-1)
    keep = math.ceil(density * norms.numel())
    order = torch.sort(norms, descending=True, stable=True).indices[:keep]
    grid = torch.zeros(gh * gw, dtype=torch.bool, device=w_nk.device)
    grid[order] = True
    return grid.reshape(gh, gw).repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]


def joint_choice(cal, site, d, objective, base: float, ref: float, xs, cands: list[int]):
    """``(fitted params, kept (N, K) or None)`` of the choice for one GEMM weight of calibration ``cal``, whose width,
    density and error go into ``d`` with every trial: of its widths (``cands`` and its own) and block densities
    (``cal.cfg.densities``, its largest blocks kept), those whose added relative output error (``objective`` of the
    weight as it would run, against ``base``, over ``ref``) stays within the tolerance, the cheapest by ``cal.price``
    (ties: more blocks, then more bits)."""
    w = site.weight
    w_nk = site.to_nk(cal.weights[w]).float()
    tesa = cal.g.tesa(w)
    kept_now = site.to_nk(tesa.mask).to(w_nk.device)
    options = []
    for bits in [d.bits_before, *cands]:
        params, q = None, w_nk
        if bits < cal.model_bits[w]:
            params, _ = cal.fit(site, bits, objective)
            q = fake_quant_float(w_nk, bits) if params is None else params.dequantize(w_nk)
        q = q * kept_now
        at_bits = tesa if bits >= cal.model_bits[w] else tesa.meet(TeSA.dense(tesa.shape, bits))
        for density in (1.0, *cal.cfg.densities):
            keep = kept_now if density == 1.0 else \
                kept_now & block_magnitude_mask(w_nk * kept_now, density, cal.cfg.prune_block)
            added = (float(objective(q if density == 1.0 else q * keep).sum()) - base) / ref
            if density == 1.0:
                d.trials[bits] = added
            else:
                d.prune_trials[f"{density:g}@{bits}"] = added
            if added <= cal.cfg.tolerance or (bits == d.bits_before and density == 1.0):    # or as it is
                candidate = at_bits if density == 1.0 else \
                    at_bits.meet(TeSA.from_mask(site.from_nk(keep.float(), tesa.shape).cpu() != 0, bits=32))
                options.append((cal.price(cal.g, site.op, site.weight, candidate, cal.profile), -density, -bits,
                                density, bits, added, params, None if density == 1.0 else keep))
    _, _, _, d.density, d.bits, d.error, params, keep = min(options, key=lambda o: o[:3])
    return params, keep


__all__ = ["block_magnitude_mask", "check_densities", "joint_choice"]
