"""Tensor scrambling: infer TeSAs of a black-box op by running it on random data.

Forward: inputs are random at kept positions and exactly zero at pruned ones; the op
runs ``trials`` times (never once: one sample says nothing); output positions that are
exactly zero in every trial become pruned. Non-finite outputs count as non-zero. The
trials mix distributions (normal, all-positive, all-negative, wide, narrow) so that ops
zero on a half-space (``relu(a - b)``) are not mistaken for structural zeros.

Backward: random output gradients at kept (needed) output positions, autograd to the
inputs; input positions whose gradient is zero in every trial are irrelevant to the op.
Inputs without gradients (integers, or ops autograd cannot differentiate) are left alone.

Integer and boolean inputs are structure, not values: a weight of such a dtype keeps
its real data (position ids, masks), other integer inputs are drawn in a small range.
Seeded and deterministic; runs on any device.
"""

from __future__ import annotations

import torch

from ..graph import Op
from ..tesa import TeSA
from .rules.common import kept, refine

DISTRIBUTIONS = ("normal", "positive", "negative", "wide", "narrow", "uniform")


def _sample(shape, dtype, trial: int, gen: torch.Generator, device) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen, device=device) < 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 3, shape, generator=gen, device=device).to(dtype)
    kind = DISTRIBUTIONS[trial % len(DISTRIBUTIONS)]
    x = torch.randn(shape, generator=gen, device=device)
    x = torch.where(x == 0, torch.ones_like(x), x)
    if kind == "positive":
        x = x.abs()
    elif kind == "negative":
        x = -x.abs()
    elif kind == "wide":
        x = x * 100
    elif kind == "narrow":
        x = x * 1e-2
    elif kind == "uniform":
        x = torch.rand(shape, generator=gen, device=device) * 2 - 1
        x = torch.where(x == 0, torch.full_like(x, 0.5), x)
    return x.to(dtype)


def scramble(op: Op, ins: list[TeSA], outs: list[TeSA], *, trials: int = 16, seed: int = 0,
             constants: dict[str, torch.Tensor] | None = None, device="cpu", backward: bool = True):
    """Infer refined (ins, outs) TeSAs of ``op`` by random trials. Returns None if it cannot run."""
    if trials < 2:
        raise ValueError("scrambling needs at least 2 trials (one sample has no variance)")
    if op.target is None:
        return None
    constants = constants or {}
    dtypes = op.meta.get("in_dtypes") or [torch.float32] * len(ins)
    gen = torch.Generator(device=device).manual_seed(seed)
    ever_nonzero = [torch.zeros(t.shape, dtype=torch.bool, device=device) for t in outs]
    ever_grad = [torch.zeros(t.shape, dtype=torch.bool, device=device) for t in ins]
    can_grad = [dt.is_floating_point and name not in constants for name, dt in zip(op.inputs, dtypes)]
    grad_ok = backward and any(can_grad)
    for trial in range(trials):
        env = {}
        for name, t, dt, g in zip(op.inputs, ins, dtypes, can_grad):
            if name in env:
                continue
            if name in constants and not dt.is_floating_point:
                x = constants[name].to(device)
            else:
                x = _sample(t.shape, dt, trial, gen, device)
                x = x * kept(t).to(device).to(x.dtype) if dt != torch.bool else x & kept(t).to(device)
            env[name] = x.detach().requires_grad_(grad_ok and g)
        try:
            with torch.enable_grad():
                result = op.call(env)
        except Exception:  # noqa: BLE001 - a black box that fails on random data gets no TeSA
            return None
        if len(result) != len(outs):
            return None
        for i, r in enumerate(result):
            if isinstance(r, torch.Tensor) and tuple(r.shape) == outs[i].shape:
                ever_nonzero[i] |= (r.detach() != 0) | ~torch.isfinite(r.detach().float())
            else:
                ever_nonzero[i] |= True
        if grad_ok:
            grad_ok = _accumulate_grads(op, env, result, outs, ever_grad, gen, device, can_grad)
    new_outs = [refine(t, m.cpu()) for t, m in zip(outs, ever_nonzero)]
    if not grad_ok:
        return list(ins), new_outs
    new_ins = [refine(t, m.cpu()) if g else t for t, m, g in zip(ins, ever_grad, can_grad)]
    return new_ins, new_outs


def _accumulate_grads(op, env, result, outs, ever_grad, gen, device, can_grad) -> bool:
    pairs = [(r, t) for r, t in zip(result, outs) if isinstance(r, torch.Tensor) and r.requires_grad]
    if not pairs:
        return False
    grads_out = []
    for r, t in pairs:
        g = torch.randn(r.shape, generator=gen, device=device, dtype=torch.float32)
        g = torch.where(g == 0, torch.ones_like(g), g) * kept(t).to(device)
        grads_out.append(g.to(r.dtype))
    leaves = [env[name] for name, g in zip(op.inputs, can_grad) if g]
    try:
        grads = torch.autograd.grad([r for r, _ in pairs], leaves, grads_out, allow_unused=True)
    except Exception:  # noqa: BLE001 - not differentiable: no backward inference
        return False
    it = iter(grads)
    for i, (name, g) in enumerate(zip(op.inputs, can_grad)):
        if g:
            gr = next(it)
            if gr is not None:
                ever_grad[i] |= (gr != 0) | ~torch.isfinite(gr)
    return True
