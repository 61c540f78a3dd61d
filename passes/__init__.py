"""Graph passes: TeSA propagation (rules, scrambling, fixed point) and plan transformation."""

from .propagate import PropagationReport, propagate
from .quant import QuantConfig, QuantReport
from .quant import calibrate as _calibrate
from .rules import RULES, get_rule, rule, unregister
from .scramble import scramble
from .simplify import simplify
from .transform import Plan, load_profile, transform
from .transform.price import plan_price


def calibrate(graph, calibration, tolerance, **options):
    """:func:`sparta.passes.quant.calibrate` with the planner's prices for its joint plan (``densities``)."""
    options.setdefault("price", plan_price)
    return _calibrate(graph, calibration, tolerance, **options)


quantize = calibrate  # the paper's quantization rule, by calibration

__all__ = ["transform", "quantize", "calibrate", "QuantConfig", "QuantReport", "Plan", "load_profile", "propagate", "PropagationReport", "rule", "get_rule", "unregister", "RULES", "scramble", "simplify"]
