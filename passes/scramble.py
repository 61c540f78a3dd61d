"""Tensor scrambling: infer TeSAs of a black-box op by running it on random data.

Forward: inputs are random at kept positions and exactly zero at pruned ones; the op
runs ``trials`` times (never once: one sample says nothing); output positions that are
exactly zero in every trial become pruned. Non-finite outputs count as non-zero. The
trials mix distributions (normal, all-positive, all-negative, wide, narrow) so that ops
zero on a half-space (``relu(a - b)``) are not mistaken for structural zeros.

Backward: random output gradients at kept (needed) output positions, autograd to the
inputs; input positions whose gradient is zero in every trial are candidates for
irrelevance. A zero gradient is not proof: which element ``sort``, ``topk``, a max or a
routing gate selects depends on the values, and autograd is blind through ``floor`` or
``argmax``. So the candidates are then checked by perturbation: they are redrawn (all at
once, from several distributions) with every other input fixed; if any needed output
changes, the input is left alone. Inputs without gradients (integers, or ops autograd
cannot differentiate) are left alone.

Integer inputs may be indices: a constant (buffer) keeps its real data, and an op reading
a non-constant integer tensor is not scrambled at all (random draws cannot cover every
index it may be given; such ops get rules, ``passes/rules/index.py``). Boolean inputs
are drawn at random. Seeded and deterministic; runs on any device.
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
    if any(_is_index(dt) and name not in constants for name, dt in zip(op.inputs, dtypes)):
        return None
    gen = torch.Generator(device=device).manual_seed(seed)
    ever_nonzero = [torch.zeros(t.shape, dtype=torch.bool, device=device) for t in outs]
    ever_grad = [torch.zeros(t.shape, dtype=torch.bool, device=device) for t in ins]
    can_grad = [dt.is_floating_point and name not in constants for name, dt in zip(op.inputs, dtypes)]
    grad_of = dict(zip(op.inputs, can_grad))
    grad_ok = backward and any(can_grad)
    draw = _Draw(op, ins, dtypes, constants, gen, device)
    for trial in range(trials):
        env = {name: x.requires_grad_(grad_ok and grad_of[name]) for name, x in draw.env(trial).items()}
        result = _run(op, env, outs)
        if result is None:
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
    new_ins = list(ins)
    for i, (name, t, g) in enumerate(zip(op.inputs, ins, can_grad)):
        candidates = kept(t).to(device) & ~ever_grad[i]
        if g and candidates.any() and draw.irrelevant(name, candidates, new_outs):
            new_ins[i] = refine(t, ever_grad[i].cpu())
    return new_ins, new_outs


def _is_index(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _run(op: Op, env: dict, outs: list[TeSA]):
    try:
        with torch.enable_grad():
            result = op.call(env)
    except Exception:  # noqa: BLE001 - a black box that fails on random data gets no TeSA
        return None
    return result if len(result) == len(outs) else None


class _Draw:
    """Random inputs of one op: zeros at pruned positions, integer constants as they are."""

    def __init__(self, op: Op, ins, dtypes, constants, gen, device):
        self.op, self.gen, self.device = op, gen, device
        self.specs = {}
        for name, t, dt in zip(op.inputs, ins, dtypes):
            self.specs.setdefault(name, (t, dt, constants.get(name) if not dt.is_floating_point else None))

    def one(self, name: str, trial: int) -> torch.Tensor:
        t, dt, constant = self.specs[name]
        if constant is not None:
            return constant.to(self.device)
        x = _sample(t.shape, dt, trial, self.gen, self.device)
        keep = kept(t).to(self.device)
        return (x & keep if dt == torch.bool else x * keep.to(x.dtype)).detach()

    def env(self, trial: int) -> dict[str, torch.Tensor]:
        return {name: self.one(name, trial) for name in self.specs}

    def irrelevant(self, name: str, candidates: torch.Tensor, outs: list[TeSA], rounds: int = 6) -> bool:
        """Whether redrawing ``name``'s ``candidates`` leaves every needed output as it was."""
        for r in range(rounds):
            base = self.env(r)
            moved = dict(base)
            moved[name] = torch.where(candidates, self.one(name, r + 1), base[name])
            with torch.no_grad():
                a, b = _run(self.op, base, outs), _run(self.op, moved, outs)
            if a is None or b is None:
                return False
            for x, y, t in zip(a, b, outs):
                if not isinstance(x, torch.Tensor) or x.shape != y.shape or tuple(x.shape) != t.shape:
                    return False
                need = kept(t).to(x.device)
                same = (x == y) | (torch.isnan(x.float()) & torch.isnan(y.float()))
                if not bool(same[need].all()):
                    return False
        return True


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
