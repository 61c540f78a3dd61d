"""Quantization by calibration: quantisers, the lock-step walk and the per-op bit search."""

from ...errors import QuantizationError
from .calibrate import QuantConfig, calibrate
from .report import Decision, QuantReport
from .sites import fake_quantized_weights, weight_sites
from .scheme import QuantParams, fake_quant_rows, fit_weight, weight_params

__all__ = ["calibrate", "QuantConfig", "QuantReport", "Decision", "QuantizationError", "QuantParams",
           "fit_weight", "weight_params", "fake_quant_rows", "weight_sites", "fake_quantized_weights"]
