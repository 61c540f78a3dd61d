"""``sparta.compile``: its arguments checked, then the flat list of passes of ``sparta/pipeline.py``; ``sparta.load``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .compiled_model import CompiledModel, run_mode
from .errors import QuantizationError, SpartaError
from .pipeline import CompileContext, CompileOptions, attach_tesa, run_passes  # noqa: F401  (sparta.attach_tesa)

TARGETS = ("cpu", "cuda")


def compile(model, initial_tesa: Mapping | None = None, example_inputs=(), *, example_kwargs=None,
            parameters=None, target: str = "cpu", propagate: bool = True, verify: bool = False, calibration=None,
            quant_tolerance=None, dismantle: str | None = None, profile=None, inductor=None,
            dynamic=None, tokens=None, measure: bool = False, formats=None) -> CompiledModel:
    """Capture ``model``, attach and propagate TeSAs, plan and specialise kernels.

    ``model`` is a ``torch.nn.Module`` (with ``example_inputs``) or an ONNX model/path.
    ``initial_tesa`` maps parameter/tensor names to :class:`TeSA` (or bool masks). For an ONNX file
    exported by ``torch.onnx.export``, ``parameters`` (the model's ``state_dict`` or the module) maps the
    user's parameter names onto the file's renamed initializers (see ``sparta.from_onnx``).
    ``dismantle`` ("full", "tile", "none") overrides the plan's per-op dismantle level,
    which by default follows the target's measured profile. ``profile`` (a profile JSON path, e.g. one measured on
    this machine by ``python -m sparta.codegen.profile --target cpu --kernels sparta -o host.json``, or a
    ``HardwareProfile``) replaces the target's shipped cost model; the plan report names the one used.
    ``calibration`` (batches of example inputs) with ``quant_tolerance`` (the relative output MSE
    one op may add; or a ``sparta.passes.QuantConfig``, or a dict of its options) lowers each
    weight's bits as far as calibration allows (``sparta.passes.calibrate``); the chosen bits
    select the int8/int4 kernels. The report is ``compiled.quantization``.
    ``inductor`` is the third stage: how the model's calls run through ``torch.compile`` (Inductor fuses the torch ops
    around sparta's kernel ops): ``"cudagraph"`` (Inductor's default mode, each input shape's forward captured by sparta
    in one CUDA graph), a ``torch.compile`` mode, or ``False`` for none; default: ``"cudagraph"`` on CUDA, none on the
    CPU. See :attr:`CompiledModel.inductor`.
    ``dynamic``: how the inputs' sizes are captured. By default (None) a torch module's batch and sequence dimensions
    stay free (captured symbolic by ``torch.export``; every kernel built for any number of rows): one compile serves
    every batch and sequence length the model allows; where the model cannot be captured so, it is captured for the
    example's shapes with a warning and the reason in the plan report. True demands the free dimensions (an error
    where they cannot be); False specialises to the example's shapes (ONNX models always are); a dict is
    ``torch.export``'s ``dynamic_shapes`` (by forward's parameter names, e.g. ``{"input_ids": {0: Dim.AUTO}}``: only
    the batch free). On CUDA the 16-bit block-sparse linears of a dynamic model also get the few-row GEMV and the
    tile kernels of smaller M tiles over the same packed blocks, each run for the calls of its bucket of rows.
    ``tokens`` = ``(lo, hi)``: the tokens (batch x sequence) calls of a dynamic model will bring; every GEMM's plan is
    costed across them (each op's rows scaled from the example's) and picks the cover cheapest relative to dense
    over the range, the report showing the estimates at its ends. Default for a dynamic model: 1 to the example's.
    ``measure=True``: time every sparse op against its dense op at the example's shapes on the target's device (the
    CPU; a GPU if this machine has one) and run dense those more than 10% slower, the plan noting the measurement
    (the estimate overridden; :meth:`CompiledModel.run_dense`).
    ``formats``: the number formats (``sparta.formats``) the weights' bits mean where not the default (int4/int8,
    fp16 or bf16 by the model's dtype, fp32): a format name for every weight of its width (``"fp8_e4m3"``) or a dict
    of weight names to format names (``{"fc1.weight": "fp8_e4m3"}``); the plan report shows them.
    """
    if target not in TARGETS:
        raise SpartaError(f"unknown target {target!r}; expected one of {TARGETS}")
    if dismantle not in (None, "full", "tile", "none"):
        raise SpartaError(f"dismantle must be 'full', 'tile', 'none' or None, got {dismantle!r}")
    if dynamic is not None and not isinstance(dynamic, (bool, dict)):
        raise SpartaError(f"dynamic must be None, True, False or a torch.export dynamic_shapes dict, got {dynamic!r}")
    for flag, value in (("propagate", propagate), ("verify", verify), ("measure", measure)):
        if not isinstance(value, bool):
            raise SpartaError(f"{flag} must be True or False, got {value!r}")
    from .passes.transform.profile import HardwareProfile
    if profile is not None and not isinstance(profile, (str, os.PathLike, HardwareProfile)):
        raise SpartaError(f"profile must be a hardware profile JSON path or a HardwareProfile (None: the target's "
                          f"own), got {profile!r}")
    options = CompileOptions(target, initial_tesa, example_inputs, example_kwargs, parameters, propagate, verify,
                             dismantle, profile, run_mode(inductor, target), dynamic, tokens, measure,
                             _quantizer(calibration, quant_tolerance, target), formats=_checked_formats(formats))
    return run_passes(CompileContext(model, options)).compiled


def _checked_formats(formats):
    from .passes.transform.bitround import check_formats
    check_formats(formats)
    return formats


def load(path, trust_kernels: bool = False, inductor=None, weights=None) -> CompiledModel:
    """Load a model written by ``compiled.save(path)``; CUDA models need no TVM.

    A CPU model's kernels are rebuilt from their saved specs (TVM needed; a kernel this machine
    built before comes from the kernel cache). ``trust_kernels=True`` loads the compiled
    libraries in the folder instead: native code that runs in this process, so only for folders
    you trust as you would a Python package (it must be True or False). ``inductor`` as for :func:`compile`.
    ``weights``: the checkpoint the weights come from (needed for a ``save(path, weights=False)`` folder; for a full
    save it replaces the saved values, same masks): an ``nn.Module``, a state dict, a ``.safetensors`` file, a list
    of them (a sharded checkpoint) or a folder of them. Each weight is taken by its state-dict name, checked (shape,
    dtype, zero where its mask prunes) and packed as compile packs it (``docs/saved-models.md``).
    """
    from .saved import read
    compiled = read(path, CompiledModel, trust_kernels, weights)
    compiled.inductor = inductor
    return compiled


def _quantizer(calibration, quant_tolerance, target: str):
    """The calibration pass ``compile`` runs between propagation and transformation (or None)."""
    if calibration is None and quant_tolerance is None:
        return None
    if calibration is None or quant_tolerance is None:
        raise SpartaError("quantization needs both calibration (batches of inputs) and quant_tolerance")
    from .passes import calibrate                   # with the planner's prices for a joint plan
    from .passes.quant import QuantConfig
    if isinstance(quant_tolerance, Mapping):
        import dataclasses
        known = {f.name for f in dataclasses.fields(QuantConfig)}
        if unknown := sorted(set(quant_tolerance) - known):
            raise QuantizationError(f"quant_tolerance has unknown options {unknown}; known: {sorted(known)}")
        config = QuantConfig(**quant_tolerance)
    elif isinstance(quant_tolerance, QuantConfig):
        config = quant_tolerance
    else:
        config = QuantConfig(quant_tolerance)
    return lambda graph: calibrate(graph, calibration, config, target=target)
