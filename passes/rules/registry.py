"""The rule table: op type → propagation rule, filled by the ``@rule`` decorator.

A rule is a pure function ``rule(op, ins, outs) -> (new_ins, new_outs) | None`` of the
op's attributes and the current TeSAs of its inputs and outputs. It returns refined
TeSAs (each at most the one it was given: the fixed point checks this) or None when it
has nothing to say. Output refinements are facts (the element is zero); input
refinements say which elements this op does not need (irrelevant to its kept outputs).
Users register rules for their own ops the same way; a later registration overrides.
"""

from __future__ import annotations

from collections.abc import Callable

from ...errors import PropagationError

RuleFn = Callable  # (Op, list[TeSA], list[TeSA]) -> tuple[list[TeSA], list[TeSA]] | None

RULES: dict[str, RuleFn] = {}


def rule(*op_types: str, override: bool = True):
    """Register the decorated function as the propagation rule of ``op_types``."""
    if not op_types or not all(isinstance(t, str) and t for t in op_types):
        raise PropagationError("@rule needs one or more op type names, e.g. @rule('linear', 'addmm')")

    def register(fn: RuleFn) -> RuleFn:
        for t in op_types:
            if t in RULES and not override:
                raise PropagationError(f"a rule for {t!r} is already registered ({RULES[t].__name__})")
            RULES[t] = fn
        return fn

    return register


def get_rule(op_type: str) -> RuleFn | None:
    return RULES.get(op_type)


def unregister(*op_types: str) -> None:
    for t in op_types:
        RULES.pop(t, None)
