"""Graph passes: TeSA propagation (rules, scrambling, fixed point) and plan transformation."""

from .propagate import PropagationReport, propagate
from .rules import RULES, get_rule, rule, unregister
from .scramble import scramble
from .simplify import simplify
from .transform import Plan, load_profile, transform

__all__ = ["transform", "Plan", "load_profile", "propagate", "PropagationReport", "rule", "get_rule", "unregister", "RULES", "scramble", "simplify"]
