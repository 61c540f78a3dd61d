"""``sparta.compile``: the whole pipeline as a flat list of passes, and CompiledModel."""

from __future__ import annotations

import difflib
import time
from collections.abc import Mapping

import torch
from torch.utils import _pytree as pytree

from .errors import GraphError, QuantizationError, SpartaError, TeSAError
from .passes.simplify import simplify
from .graph import Graph
from .shapes import capture_shapes, plan_tokens
from .runtime.inductor import compiled_runner, inductor_mode
from .sampling import random_inputs, verification_sizes
from .target import load_target
from .text import table
from .tesa import TeSA

TARGETS = ("cpu", "cuda")


class VerificationError(SpartaError):
    """The compiled model disagrees with its dense reference."""


def attach_tesa(graph: Graph, initial_tesa: Mapping | None) -> Graph:
    """Attach user TeSAs by parameter or tensor name (TeSA, or a bool mask tensor)."""
    if initial_tesa is None:
        return graph
    if not isinstance(initial_tesa, Mapping):
        raise TeSAError(f"initial_tesa must be a mapping of parameter or tensor names to TeSAs (a dict), "
                        f"got {type(initial_tesa).__name__}")
    known = graph.tensor_names() + list(graph.meta.get("aliases", {}))
    for name, tesa in initial_tesa.items():
        if not isinstance(name, str):
            raise TeSAError(f"initial_tesa keys must be parameter or tensor names (str), got {name!r}")
        try:
            graph.resolve(name)
        except GraphError:
            close = [k for k in known if k.startswith(name + ".")][:3] or difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise TeSAError(f"TeSA given for unknown parameter or tensor {name!r}{hint}") from None
        if isinstance(tesa, torch.Tensor) and tesa.dtype == torch.bool:
            tesa = TeSA.from_mask(tesa, name=name)
        elif isinstance(tesa, torch.Tensor) and not tesa.is_floating_point():
            raise TeSAError(f"TeSA for {name!r}: an integer tensor is ambiguous; pass TeSA.from_bits(bits) for bit "
                            "widths or a bool mask (mask.bool()) for kept elements")
        if not isinstance(tesa, TeSA):
            raise TeSAError(f"TeSA for {name!r}: expected a sparta.TeSA or a bool mask tensor, "
                            f"got {type(tesa).__name__}{' of ' + str(tesa.dtype) if isinstance(tesa, torch.Tensor) else ''}")
        graph.set_tesa(name, graph.tesa(name).meet(tesa.check_shape(graph.tesa(name).shape, name)))
    return graph


def masked_weights(graph: Graph) -> dict[str, torch.Tensor]:
    """Weights with their pruned elements zeroed (the dense reference's weights)."""
    out = {}
    for v in graph.tensors("weight"):
        if v.data is not None and not v.tesa.is_dense:
            out[v.name] = v.tesa.apply(v.data)
    return out


def compile(model, initial_tesa: Mapping | None = None, example_inputs=(), *, example_kwargs=None,
            parameters=None, target: str = "cpu", propagate: bool = True, verify: bool = False, calibration=None,
            quant_tolerance=None, dismantle: str | None = None, profile=None, inductor=None,
            dynamic=None, tokens=None, measure: bool = False) -> CompiledModel:
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
    quantize = _quantizer(calibration, quant_tolerance, target)
    inductor = inductor_mode(inductor, target)
    timings = {}
    t0 = time.perf_counter()
    graph = capture_shapes(model, example_inputs, example_kwargs, parameters, dynamic)
    timings["capture"] = time.perf_counter() - t0
    attach_tesa(graph, initial_tesa)
    source = graph.copy()       # the model with only the user's TeSAs: what verify() checks propagation against
    graph = simplify(graph)
    if target == "cuda":        # one launch for the linears that read one input (q/k/v, gate/up)
        from .passes.simplify import fuse_sibling_linears
        graph = fuse_sibling_linears(graph)
    plan_tokens(graph, tokens)
    chosen = _target(target, profile)
    graph, plan = _propagate_and_plan(graph, chosen, propagate, timings, quantize)
    if dismantle is not None:
        for op_plan in list(plan.ops.values()):
            if op_plan.kind == "sparse":
                plan.pin(op_plan.op, dismantle=dismantle)
    replacements, kernels = {}, []
    if target == "cpu":
        from .codegen.select_cpu import select_kernels
        from .codegen.specialize import specialize
        select_kernels(graph, plan, chosen)
        t0 = time.perf_counter()
        replacements, kernels = specialize(graph, plan, target)
        timings["codegen"] = time.perf_counter() - t0
    elif target == "cuda":
        from .codegen.select_cuda import select_kernels
        from .codegen.specialize_cuda import specialize_cuda
        t0 = time.perf_counter()
        select_kernels(graph, plan, chosen)
        timings["select"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        replacements, kernels = specialize_cuda(graph, plan, chosen)
        timings["codegen"] = time.perf_counter() - t0
    from .codegen.select_attention import attention_modules
    replacements.update(attention_modules(graph, plan))
    compiled = CompiledModel(graph, target=target, plan=plan, replacements=replacements, timings=timings,
                             kernels=kernels, source=source, inductor=inductor)
    if measure:
        from .dense_fallback import measure_and_fall_back
        t0 = time.perf_counter()
        measure_and_fall_back(compiled)
        compiled.timings["measure"] = time.perf_counter() - t0
    if verify:
        compiled.verify()
    return compiled


def load(path, trust_kernels: bool = False, inductor=None) -> CompiledModel:
    """Load a model written by ``compiled.save(path)``; CUDA models need no TVM.

    A CPU model's kernels are rebuilt from their saved specs (TVM needed; a kernel this machine
    built before comes from the kernel cache). ``trust_kernels=True`` loads the compiled
    libraries in the folder instead: native code that runs in this process, so only for folders
    you trust as you would a Python package. ``inductor`` as for :func:`compile`.
    """
    from .saved import read
    compiled = read(path, CompiledModel, trust_kernels)
    compiled.inductor = inductor
    return compiled


def _quantizer(calibration, quant_tolerance, target: str):
    """The calibration pass ``compile`` runs between propagation and transformation (or None)."""
    if calibration is None and quant_tolerance is None:
        return None
    if calibration is None or quant_tolerance is None:
        raise SpartaError("quantization needs both calibration (batches of inputs) and quant_tolerance")
    from .passes.quant import QuantConfig, calibrate
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


def _target(name: str, profile):
    """The Target ``compile`` plans for: ``name``'s, its cost model replaced by ``profile`` if given; on the CPU
    without one, this machine's (``codegen.profile.host_profile``: measured here on first use where the shipped
    profile is another CPU's)."""
    from .passes.transform.profile import load_profile
    if profile is None and name == "cpu":
        from .codegen.profile import host_profile
        profile = host_profile()
    try:
        return load_target(name, load_profile(profile) if profile is not None else None)
    except (SpartaError, OSError, ValueError) as exc:       # a missing file, bad JSON, an invalid profile
        raise SpartaError(f"profile {profile!r}: {exc}") from None


def _propagate_and_plan(graph: Graph, target, propagate: bool, timings: dict, quantize=None):
    """Propagation, calibration (when asked) and transformation; without calibration both
    passes are read back from the pipeline cache when nothing they read changed."""
    from . import pipeline_cache
    from .passes import propagate as run_propagation
    from .passes import transform
    from .passes.propagate import PropagationReport
    from .passes.transform import Plan

    t0 = time.perf_counter()
    # calibration reads weight values and data, which the key does not hash: it bypasses the cache
    options = {"propagate": propagate, "profile": target.profile.to_json(),
               "dynamic": sorted(graph.meta.get("dynamic_dims", {})),    # (and the weights it keeps)
               "tokens": graph.meta.get("token_range")}
    key = pipeline_cache.pipeline_key(graph, target.name, options) if quantize is None else None
    hit = pipeline_cache.load(key) if key is not None else None
    if hit is not None:
        tesas, report, plan = hit
        for name, tesa in tesas.items():
            graph.set_tesa(name, tesa)
        if report is not None:
            graph.meta["propagation"] = PropagationReport.from_json(report)
        plan = Plan.from_json(plan)
        _refit_weight_quant(graph, plan, target.profile)
        timings["plan_cache"] = time.perf_counter() - t0
        return graph, plan
    if propagate:
        t0 = time.perf_counter()
        graph = run_propagation(graph)
        timings["propagate"] = time.perf_counter() - t0
    if quantize is not None:
        t0 = time.perf_counter()
        quantize(graph)
        timings["calibrate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = transform(graph, target)
    timings["transform"] = time.perf_counter() - t0
    if key is not None:
        report = graph.meta.get("propagation")
        pipeline_cache.store(key, graph, report.to_json() if report is not None else None, plan.to_json())
    return graph, plan


def _refit_weight_quant(graph: Graph, plan, profile) -> None:
    """Scales a cached plan fitted to the weights alone, fitted again: the cache key hashes no float weight values."""
    from .passes.transform import weight_quantisation
    for p in plan.ops.values():
        if p.weight_quant:
            p.weight_quant = weight_quantisation(graph, graph.op(p.op), p, {}, profile)


class CompiledModel(torch.nn.Module):
    """A model compiled by sparta: call it like the original module."""

    def __init__(self, graph: Graph, *, target: str = "cpu", plan=None, replacements=None, timings=None,
                 kernels=None, source: Graph | None = None, inductor: str | None = None):
        super().__init__()
        self.graph = graph
        self.source_graph = source
        self.target = target
        self.plan = plan
        self.timings = dict(timings or {})
        self.kernels = list(kernels or [])
        self.quantization = graph.meta.get("quantization")   # the calibration report, if one ran
        self._source_reference = None
        self._propagated_module = None
        self._inductor = inductor                            # a mode inductor_mode resolved (None: none)
        self.rebuild(replacements or {})

    def rebuild(self, replacements: Mapping[str, torch.nn.Module]) -> None:
        """Run the graph with these kernel modules standing in for its ops (the rest as torch ops), on the device
        the model is on."""
        from .backend.fx import to_graph_module
        device = self.device if hasattr(self, "module") else None
        self._replacements = dict(replacements)
        self.module = to_graph_module(self.graph, masked_weights(self.graph), self._replacements)
        if device is not None:
            self.module.to(device)
        # the reference sees what the kernels really apply: quantised weights dequantised
        self._reference_weights = {**masked_weights(self.graph), **{
            m.weight_name: m.reference_weight for m in self._replacements.values()
            if getattr(m, "reference_weight", None) is not None}}
        self._quantized = any(k.get("bits", "W32A32") != "W32A32" for k in self.kernels)
        self._reference, self._inductor_fn = None, None

    def run_dense(self, ops, why: str = "asked for") -> list[str]:
        """Run these sparse ops as their dense torch ops (their fused activations too); the plan says so, with
        ``why``. ``compiled.run_dense(compiled.profile().slower_than_dense(), "measured slower")`` closes the loop."""
        from .dense_fallback import run_dense
        return run_dense(self, ops, why)

    @property
    def inductor(self) -> str | None:
        """How calls run through torch.compile once the model is on its target's device (None: the fx module runs as
        it is): ``"cudagraph"`` compiles in Inductor's default mode and replays one CUDA graph per input shape,
        captured on that shape's first call (the inputs are copied in; a call costs the host ~30 µs); any other
        value is a ``torch.compile`` mode. Under ``"cudagraph"`` and ``"reduce-overhead"`` a call's outputs are
        overwritten by the next call of the same shape (clone what you keep). Settable."""
        return self._inductor

    @inductor.setter
    def inductor(self, mode) -> None:
        self._inductor, self._inductor_fn = inductor_mode(mode, self.target), None

    def _run(self, flat):
        """The fx module on the graph's flat inputs, through torch.compile where ``inductor`` says."""
        if self._inductor is None or self.device.type != self.target:
            return self.module(*flat)
        if self._inductor_fn is None:
            self._inductor_fn = compiled_runner(self.module, self._inductor)
        return self._inductor_fn(*flat)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():   # Dynamo guards the shapes itself: take the inputs as they come
            outs = self.module(*self.graph.flat_inputs(args, kwargs, check=False))
        else:
            outs = self._run(self.graph.flat_inputs(args, kwargs))
        out_spec = self.graph.meta.get("out_spec")
        return pytree.tree_unflatten(list(outs), out_spec) if out_spec is not None else outs

    def tesa(self, name: str) -> TeSA:
        return self.graph.tesa(name)

    def module_replacements(self) -> dict[str, torch.nn.Module]:
        """The kernel modules standing in for graph ops, by op name."""
        return dict(self._replacements)

    def save(self, path) -> str:
        """Write the model (graph, plan, weights, kernels) to the folder ``path``; reload with ``sparta.load``."""
        from .saved import save
        return str(save(self, path))

    @property
    def device(self) -> torch.device:
        """Where the kernel modules' tensors live (CPU until ``.to('cuda')``)."""
        for t in self.module.buffers():
            return t.device
        for t in self.module.parameters():
            return t.device
        return torch.device("cpu")

    def reference(self) -> torch.nn.Module:
        """The dense reference: the graph run with plain torch ops on masked weights."""
        if self._reference is None:
            from .backend.fx import to_graph_module
            self._reference = to_graph_module(self.graph, self._reference_weights)
        return self._reference

    def source_reference(self) -> torch.nn.Module | None:
        """The model as given, with only the user's initial TeSAs applied (None if not known, e.g. an old save)."""
        if self._source_reference is None and self.source_graph is not None:
            from .backend.fx import to_graph_module
            self._source_reference = to_graph_module(self.source_graph, masked_weights(self.source_graph))
        return self._source_reference

    def _propagated(self) -> torch.nn.Module:
        """The compiled graph as plain torch ops on weights masked by the propagated TeSAs (no quantisation)."""
        if self._propagated_module is None:
            from .backend.fx import to_graph_module
            self._propagated_module = to_graph_module(self.graph, masked_weights(self.graph))
        return self._propagated_module

    def verify(self, trials: int = 2, rtol: float | None = None, atol: float | None = None, seed: int = 0) -> dict:
        """Check the compiled model on fresh random inputs; raise :class:`VerificationError` on a mismatch. A model
        captured with dynamic dimensions is checked at three shapes at least (the example's, one row, larger).

        Two checks per trial: the propagated TeSAs against the model with only the user's initial TeSAs
        (both as plain torch ops on masked fp weights: propagation may prune only what cannot change an
        output), and the kernels against the propagated graph (masked, quantised weights as the kernels
        apply them). Returns the worst relative error of each output against the model as given."""
        if not isinstance(trials, int) or trials < 1:
            raise SpartaError(f"verify needs trials >= 1, got {trials!r}")
        for what, tol in (("rtol", rtol), ("atol", atol)):
            if tol is not None and not tol >= 0:
                raise SpartaError(f"verify: {what} must be >= 0, got {tol!r}")
        worst, device = {}, self.device
        reference = self.reference().to(device)
        source = self.source_reference()
        if source is not None:
            source = source.to(device)
            propagated = self._propagated().to(device)
        for trial, sizes in enumerate(verification_sizes(self.graph, trials)):
            inputs = [x.to(device) for x in random_inputs(self.graph, seed + 1 + trial, sizes)]
            with torch.no_grad():
                got = [t.clone() for t in self._run(inputs)]
                ref = reference(*inputs)
                pairs = [("kernels", got, ref)]
                if source is not None:
                    pairs.insert(0, ("propagation", propagated(*inputs), source(*inputs)))
            for check, outs, refs in pairs:
                for name, a, b in zip(self.graph.outputs, outs, refs):
                    self._compare(check, name, a, b, trial, rtol, atol)
            for name, a, b in zip(self.graph.outputs, got, pairs[0][2]):
                scale = b.float().abs().max().clamp_min(1e-30)
                worst[name] = max(worst.get(name, 0.0), ((a.float() - b.float()).abs().max() / scale).item())
        return worst

    def _compare(self, check: str, name: str, a: torch.Tensor, b: torch.Tensor, trial: int, rtol, atol) -> None:
        what = {"propagation": "the model with only the initial TeSAs (propagation pruned something that matters)",
                "kernels": "the dense reference"}[check]
        tol_r, tol_a = _tolerance(b.dtype, rtol, atol)
        if check == "kernels" and self._quantized and rtol is None:  # int8 activations: compare at the output's scale
            tol_r, tol_a = 0.0, 5e-2 * float(b.float().abs().max())
        elif check == "kernels" and self.target == "cuda" and self.kernels and rtol is None:  # fp16 kernels, fp32 model
            tol_r, tol_a = 1e-2, 1e-2 * float(b.float().abs().max())
        if not torch.isfinite(b).all():
            raise VerificationError(f"output {name!r} of {what.split(' (')[0]} is not finite on random inputs "
                                    f"(trial {trial}); nothing to verify against")
        if not torch.allclose(a.float(), b.float(), rtol=tol_r, atol=tol_a):
            err = (a.float() - b.float()).abs().max().item()
            raise VerificationError(f"output {name!r} differs from {what}: max abs error {err:.3g} "
                                    f"(rtol={tol_r}, atol={tol_a}, trial {trial})")

    def profile(self, *args, reps: int = 10, **kwargs):
        """Time one forward op by op (sparta's kernels and torch ops inside the forward, median over ``reps``
        forwards) against the dense reference's ops and the plan's estimates, and the whole call: a
        :class:`~sparta.profiling.Profile` (``.report()``, ``.slower_than_dense()``, ``.to_json()``). No inputs:
        random ones of the example's shapes."""
        from .profiling import profile
        return profile(self, args, kwargs, reps)

    def plan_report(self, only_gemm: bool = False) -> str:
        """The execution plan as a table: op, density, bits, chosen blocks, estimated µs, dense µs."""
        if self.plan is None:
            return "no plan"
        return self.plan.report(only_gemm) + "\n" + self.shapes_line()

    def shapes_line(self) -> str:
        """The input shapes the model takes, and the token range its plan was costed over."""
        from .shapes import shapes_line
        return shapes_line(self.graph)

    def kernel_report(self) -> str:
        """The compiled kernels: op, template, blocks, bits, dismantle level, build time, cache, code size."""
        if not self.kernels:
            return "no sparta kernels (every op runs as a torch op)"
        cols = ("op", "template", "blocks", "bits", "dismantle", "build_s", "cached", "code_bytes")
        text = table([cols] + [tuple(str(k[c]) for c in cols) for k in self.kernels])
        if self.target == "cpu":
            from .runtime.cpu_threads import describe
            text += "\n" + describe()
        return text

    def report(self) -> str:
        """A table of every tensor whose TeSA is not dense: kind, shape, density, bits."""
        rows = [("tensor", "kind", "shape", "density", "bits")]
        aliases = {}
        for alias, target in self.graph.meta.get("aliases", {}).items():
            aliases.setdefault(target["tensor"], []).append(alias)
        for s in self.graph.tesa_stats():
            if s["density"] < 1.0 or len(s["bits"]) > 1:
                bits = " ".join(f"{b}:{c}" for b, c in sorted(s["bits"].items()))
                name = " = ".join([s["name"], *sorted(aliases.get(s["name"], []))])
                rows.append((name, s["kind"], "x".join(map(str, s["shape"])), f"{s['density']:.3f}", bits))
        return table(rows)


def _tolerance(dtype, rtol, atol):
    defaults = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-4, 1e-5)}
    r, a = defaults.get(dtype, (0.0, 0.0))
    return (r if rtol is None else rtol), (a if atol is None else atol)
