"""Rules for element-wise ops (unary, n-ary with broadcasting).

Whether an op maps zero to zero is not hard-coded: the rule evaluates the op itself on
zeros (with its real attributes), so ``relu``/``gelu``/``silu``/``tanh`` keep zeros,
``sigmoid``/``exp``/``cos`` do not, ``add(x, 2)`` does not, ``hardtanh(x, 0.1, 1)`` does
not. Ops whose value at zero is not finite (``log``, ``rsqrt``, ``reciprocal``, negative
powers) never prune their inputs backward, so masking a weight cannot create Inf/NaN.

* forward: ``f(0, …, 0) = 0`` ⇒ an output element is pruned when every operand element
  it reads is pruned (``add``, ``sub``, ``maximum``, ``where``, comparisons with zero …).
* ``mul``/``logical_and``: pruned when *any* operand is pruned (``0·x = 0``); backward
  also goes input → input: where the other operand is pruned, this one is irrelevant.
* ``div``-like: ``x/0`` is not zero, so the output is pruned only where the numerator is
  pruned *and* the divisor kept; the divisor is never pruned backward.
* backward: an operand element is needed iff an output element it reaches is needed
  (broadcast dims reduced with OR).

Bits: value-selecting ops (``relu``, ``clone``, ``dropout``, ``alias``, ``detach``, and
casts, capped at the target dtype's width) carry bits along both ways: their outputs are
values of the input, so the input's grid serves. Arithmetic ops leave bits unchanged.
"""

from __future__ import annotations

import math

import torch

from ...graph import Op, substitute
from ...tesa import TeSA, bits_of_dtype
from .common import any_to_shape, kept, refine, result
from .registry import rule

UNARY = ("relu", "gelu", "silu", "tanh", "sigmoid", "neg", "abs", "sqrt", "rsqrt", "exp", "expm1", "log",
         "log1p", "erf", "hardtanh", "hardswish", "hardsigmoid", "mish", "leaky_relu", "elu", "softplus",
         "sin", "cos", "square", "sign", "reciprocal", "ceil", "floor", "round", "trunc", "clamp", "clamp_min",
         "clamp_max", "clone", "dropout", "alias", "detach", "lift_fresh_copy", "_to_copy", "to", "contiguous",
         "bitwise_not", "logical_not", "pow", "relu6", "celu", "selu", "gelu_", "nan_to_num", "native_dropout")
SELECTING = {"relu", "clone", "dropout", "alias", "detach", "lift_fresh_copy", "_to_copy", "to", "contiguous",
             "native_dropout"}
ANY_OF = ("add", "sub", "rsub", "maximum", "minimum", "fmax", "fmin", "where", "masked_fill", "eq", "ne", "gt",
          "ge", "lt", "le", "logical_or", "logical_xor", "bitwise_or", "bitwise_xor", "copy", "lerp", "addcmul",
          "addcdiv")
ALL_OF = ("mul", "logical_and", "bitwise_and")
DIV_LIKE = ("div", "floor_divide", "remainder", "fmod")


def _zero_env(op: Op, ndims) -> dict[str, torch.Tensor]:
    dtypes = op.meta.get("in_dtypes") or [torch.float32] * len(op.inputs)
    ndims = ndims or [0] * len(op.inputs)
    return {name: torch.zeros((1,) * nd, dtype=dt) for name, dt, nd in zip(op.inputs, dtypes, ndims)}


def value_at_zero(op: Op, ndims: list[int] | None = None) -> float | None:
    """The op's output when every tensor operand is zero (None if it cannot be evaluated).

    Operands are 0-dim, or of shape ``(1,) * ndims[i]`` for ops that need their rank.
    """
    if op.target is None:
        return None
    try:
        env = _zero_env(op, ndims)
        with torch.no_grad():
            out = op.target(*substitute(op.args, env), **substitute(op.kwargs, env))
        if isinstance(out, (list, tuple)):
            out = out[0]
        return float(out.reshape(-1)[0]) if out.numel() else 0.0
    except Exception:  # noqa: BLE001 - an op that cannot run on scalars gets no zero claim
        return None


def _operands(op: Op, ins: list[TeSA], outs: list[TeSA]):
    """(index, TeSA, kept mask broadcast to the output shape) of each tensor operand."""
    shape = outs[0].shape
    return [(i, t, kept(t).expand(shape) if t.shape != shape else kept(t)) for i, t in enumerate(ins)]


def _backward(ins, need, gate=None, skip=()):
    """Each operand is needed where a needed output reaches it (``gate``: per-operand AND)."""
    new_ins = []
    for i, t in enumerate(ins):
        if i in skip:
            new_ins.append(t)
            continue
        n = need if gate is None or gate[i] is None else need & gate[i]
        new_ins.append(refine(t, any_to_shape(n, t.shape)))
    return new_ins


def _carry_bits(op: Op, ins: list[TeSA], outs: list[TeSA]):
    """Bits of value-selecting unary ops: output ≤ input (≤ cast width), input ≤ needed output."""
    x, y = ins[0], outs[0]
    if x.shape != y.shape:
        return x, y
    cap = x.view()
    out_dt = (op.meta.get("out_dtypes") or [None])[0]
    if out_dt is not None:
        cap = torch.clamp(cap, max=bits_of_dtype(out_dt))
    y = refine(y, bits=cap)
    return refine(x, bits=y.view()), y


@rule(*UNARY)
def unary(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if len(ins) != 1 or not outs or ins[0].shape != outs[0].shape:
        return None
    z = value_at_zero(op)
    x, y = ins[0], outs[0]
    if z == 0.0:
        y = refine(y, kept(x))
    if z is not None and math.isfinite(z):
        x = refine(x, kept(y))
    if op.op in SELECTING:
        x, y = _carry_bits(op, [x], [y])
    return result(ins, outs, [x], [y, *outs[1:]])


@rule(*ANY_OF)
def any_of(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if not ins or len(outs) != 1:
        return None
    z = value_at_zero(op)
    y = outs[0]
    if z == 0.0:
        union = torch.zeros(y.shape, dtype=torch.bool)
        for _, _, m in _operands(op, ins, outs):
            union = union | m
        y = refine(y, union)
    new_ins = _backward(ins, kept(y)) if z is not None and math.isfinite(z) else list(ins)
    return result(ins, outs, new_ins, [y])


@rule(*ALL_OF)
def all_of(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if not ins or len(outs) != 1:
        return None
    ops = _operands(op, ins, outs)
    y = outs[0]
    if len(ins) == 1:  # tensor × scalar
        other = op.attrs.get("other", 1)
        keep = ops[0][2] if other != 0 else torch.zeros((), dtype=torch.bool)
        y = refine(y, keep)
        return result(ins, outs, [refine(ins[0], kept(y))], [y])
    inter = ops[0][2]
    for _, _, m in ops[1:]:
        inter = inter & m
    y = refine(y, inter)
    need = kept(y)
    # input -> input: where another operand is pruned, this one is irrelevant
    gates = []
    for i, _, _ in ops:
        g = None
        for j, _, m in ops:
            if j != i:
                g = m if g is None else g & m
        gates.append(g)
    return result(ins, outs, _backward(ins, need, gates), [y])


@rule(*DIV_LIKE)
def div_like(op: Op, ins: list[TeSA], outs: list[TeSA]):
    if not ins or len(outs) != 1:
        return None
    y = outs[0]
    num_is_tensor = bool(op.roles) and op.roles[0] == "self"
    if not num_is_tensor:
        return None
    ops = _operands(op, ins, outs)
    num = ops[0][2]
    if len(ins) == 1:  # tensor / scalar
        other = op.attrs.get("other", 1)
        if other == 0 or (isinstance(other, float) and math.isnan(other)):
            return None
        y = refine(y, num)
    else:
        y = refine(y, num | ~ops[1][2])
    return result(ins, outs, _backward(ins, kept(y), skip=range(1, len(ins))), [y])


__all__ = ["value_at_zero", "unary", "any_of", "all_of", "div_like"]
