"""Propagation rule tables, one module per op family, registered by ``@rule``."""

from . import attention, conv, elementwise, index, matmul, norm, pool, reduce, shape  # noqa: F401  (register)
from .registry import RULES, get_rule, rule, unregister

__all__ = ["RULES", "get_rule", "rule", "unregister"]
