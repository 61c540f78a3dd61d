"""``sparta.compile`` as a flat list of passes over one typed context.

Each :class:`Pass` is a function ``(ctx) -> None`` that reads and writes fields of the :class:`CompileContext`; it
declares the targets it runs for, the option it runs under, and is timed into ``ctx.timings`` under its name (or the
key it declares). :data:`PASSES` is the pipeline in order; a pass can be run alone on a context
(``run_pass(ctx, "simplify")``, or untimed ``PASSES_BY_NAME["simplify"].run(ctx)``). The per-target selection and
specialisation come from :data:`CODEGEN`, a table by target name.
"""

from __future__ import annotations

import difflib
import importlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import GraphError, SpartaError, TeSAError
from .graph import Graph
from .tesa import TeSA


@dataclass
class CompileOptions:
    """``sparta.compile``'s arguments, checked."""

    target: str = "cpu"
    initial_tesa: Mapping | None = None
    example_inputs: Any = ()
    example_kwargs: Any = None
    parameters: Any = None
    propagate: bool = True
    verify: bool = False
    dismantle: str | None = None
    profile: Any = None
    inductor: Any = None                    # the run mode (``compiled_model.run_mode``)
    dynamic: Any = None
    tokens: Any = None
    measure: bool = False
    quantize: Callable | None = None        # the calibration pass (``compiler._quantizer``), or None
    formats: Any = None                     # number formats asked (``passes.transform.bitround.choose_formats``)


@dataclass
class CompileContext:
    """What the passes hand each other."""

    model: Any
    options: CompileOptions
    found_masks: Any = None                 # prune masks and zeros found on the model
    graph: Graph | None = None
    source: Graph | None = None             # the graph with only the user's TeSAs: what verify() checks against
    target: Any = None                      # the Target planned for
    plan: Any = None                        # the Plan
    replacements: dict = field(default_factory=dict)
    kernels: list = field(default_factory=list)
    decode_modules: dict = field(default_factory=dict)   # kernels only generate()'s decode steps run, by what
    compiled: Any = None                    # the CompiledModel
    timings: dict = field(default_factory=dict)
    folded: dict = field(default_factory=dict)   # constants fold_bn derived: name -> what they were folded from
    meta: bool = False                      # the model's parameters are on the meta device (``sparta.meta_model``)


@dataclass(frozen=True)
class Pass:
    """One pass: ``run(ctx)`` for ``targets`` where ``when(options)`` holds, timed under ``timed``."""

    name: str
    run: Callable[[CompileContext], None]
    targets: tuple[str, ...] = ("cpu", "cuda")
    timed: str | None = None                # the timings key: None → the name; "" → the pass times its own steps
    when: Callable[[CompileOptions], bool] | None = None     # the option it runs under (None: always)

    @property
    def key(self) -> str:
        return self.name if self.timed is None else self.timed

    def applies(self, options: CompileOptions) -> bool:
        return options.target in self.targets and (self.when is None or bool(self.when(options)))


CODEGEN = {  # target → (selection, specialisation): "module:function" in sparta.codegen
    "cpu": ("select_cpu:select_kernels", "specialize:specialize"),
    "cuda": ("select_cuda:select_kernels", "specialize_cuda:specialize_cuda"),
}


def _codegen(target: str, which: int) -> Callable:
    module, _, fn = CODEGEN[target][which].partition(":")
    return getattr(importlib.import_module(f"sparta.codegen.{module}"), fn)


def capture(ctx: CompileContext) -> None:
    from .frontend.prune_masks import find_masks
    from .shapes import capture_shapes
    from . import meta_model
    o = ctx.options
    if meta_model.is_meta_model(ctx.model):          # no values: no masks to find, nothing that reads them
        meta_model.check_options(o)
        ctx.meta, buffers, ctx.found_masks = True, meta_model.prepare(ctx.model), {}
    else:
        ctx.model, ctx.found_masks = find_masks(ctx.model)   # pruning made permanent on a copy
    ctx.graph = capture_shapes(ctx.model, o.example_inputs, o.example_kwargs, o.parameters, o.dynamic)
    if ctx.meta:
        meta_model.fill_buffers(ctx.graph, buffers)
        meta_model.devices_to_cpu(ctx.graph)


def attach(ctx: CompileContext) -> None:
    from .frontend.prune_masks import attach_masks
    attach_masks(ctx.graph, ctx.found_masks, ctx.options.initial_tesa)
    attach_tesa(ctx.graph, ctx.options.initial_tesa)
    if ctx.meta:
        from .meta_model import check_bits
        check_bits(ctx.graph, str(getattr(ctx.options.target, "name", ctx.options.target)))
    ctx.source = ctx.graph.copy()


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


def simplify(ctx: CompileContext) -> None:
    from .passes.simplify import simplify as run
    ctx.graph = run(ctx.graph)


def fold_bn(ctx: CompileContext) -> None:
    """Inference BatchNorms folded into the convolutions before them."""
    from .passes.fold_bn import fold_batch_norms
    ctx.graph, folded = fold_batch_norms(ctx.graph)
    ctx.folded.update(folded)


def convs_as_linears(ctx: CompileContext) -> None:
    """1×1 convolutions pruned inside channels run as linears over channels (``passes/conv_as_linear.py``)."""
    from .passes.conv_as_linear import convs_as_linears as run
    ctx.graph, derived = run(ctx.graph)
    ctx.folded.update(derived)


def shrink(ctx: CompileContext) -> None:
    """The graph rewritten to the plan's channel shrinking: sliced weights, narrow tensors, gathers and scatters."""
    from .passes.shrink_graph import shrink_graph
    ctx.graph = shrink_graph(ctx.graph, ctx.plan, ctx.target.profile, ctx.folded)


def fuse_siblings(ctx: CompileContext) -> None:
    """One launch for the linears that read one input (q/k/v, gate/up)."""
    from .passes.simplify import fuse_sibling_linears
    ctx.graph = fuse_sibling_linears(ctx.graph)


def plan_tokens(ctx: CompileContext) -> None:
    from .shapes import plan_tokens as run
    run(ctx.graph, ctx.options.tokens)


def choose_target(ctx: CompileContext) -> None:
    ctx.target = load_compile_target(ctx.options.target, ctx.options.profile)


def propagate_and_plan(ctx: CompileContext) -> None:
    """Propagation, calibration (when asked) and transformation; without calibration both are read back from the
    pipeline cache when nothing they read changed (timed under ``propagate``, ``calibrate``, ``transform`` or
    ``plan_cache``)."""
    from . import pipeline_cache
    from .passes import propagate as run_propagation
    from .passes import transform
    from .passes.propagate import PropagationReport
    from .passes.transform import Plan
    graph, target, o = ctx.graph, ctx.target, ctx.options
    t0 = time.perf_counter()
    # calibration reads weight values and data, which the key does not hash: it bypasses the cache
    options = {"propagate": o.propagate, "profile": target.profile.to_json(),
               "dynamic": sorted(graph.meta.get("dynamic_dims", {})),    # (and the weights it keeps)
               "tokens": None if graph.token_range is None else graph.token_range.__dict__,
               "formats": o.formats if isinstance(o.formats, (str, type(None))) else dict(o.formats)}
    key = pipeline_cache.pipeline_key(graph, target.name, options) if o.quantize is None else None
    hit = pipeline_cache.load(key) if key is not None else None
    if hit is not None:
        tesas, report, plan = hit
        for name, tesa in tesas.items():
            graph.set_tesa(name, tesa)
        if report is not None:
            graph.propagation = PropagationReport.from_json(report)
        ctx.plan = Plan.from_json(plan)
        _refit_weight_quant(graph, ctx.plan, target.profile)
        ctx.timings["plan_cache"] = time.perf_counter() - t0
        return
    if o.propagate:
        t0 = time.perf_counter()
        ctx.graph = graph = run_propagation(graph)
        ctx.timings["propagate"] = time.perf_counter() - t0
    if o.quantize is not None:
        t0 = time.perf_counter()
        o.quantize(graph)
        ctx.timings["calibrate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ctx.plan = transform(graph, target, formats=o.formats)
    ctx.timings["transform"] = time.perf_counter() - t0
    if key is not None:
        report = graph.propagation
        pipeline_cache.store(key, graph, report.to_json() if report is not None else None, ctx.plan.to_json())


def _refit_weight_quant(graph: Graph, plan, profile) -> None:
    """Scales a cached plan fitted to the weights alone, fitted again: the cache key hashes no float weight values."""
    from .passes.transform import weight_quantisation
    for p in plan.ops.values():
        if p.weight_quant:
            p.weight_quant = weight_quantisation(graph, graph.op(p.op), p, {}, profile)


def choose_formats(ctx: CompileContext) -> None:
    """Each sub-operator's number formats: its widths' defaults, or those ``compile(formats=...)`` asks."""
    from .passes.transform.bitround import choose_formats as run
    run(ctx.graph, ctx.plan, ctx.target, ctx.options.formats)


def pin_dismantle(ctx: CompileContext) -> None:
    """``compile(dismantle=...)`` pinned on every sparse op's plan."""
    for op_plan in list(ctx.plan.ops.values()):
        if op_plan.kind == "sparse":
            ctx.plan.pin(op_plan.op, dismantle=ctx.options.dismantle)


def select(ctx: CompileContext) -> None:
    """Kernel selection and the fusion pass after it (``CODEGEN``'s selection for the target)."""
    _codegen(ctx.target.name, 0)(ctx.graph, ctx.plan, ctx.target)


def specialize(ctx: CompileContext) -> None:
    replacements, ctx.kernels = _codegen(ctx.target.name, 1)(ctx.graph, ctx.plan, ctx.target)
    ctx.replacements.update(replacements)


def attention(ctx: CompileContext) -> None:
    from .codegen.select_attention import attention_modules
    ctx.replacements.update(attention_modules(ctx.graph, ctx.plan))


def decode_kernels(ctx: CompileContext) -> None:
    """A Hugging Face decoder's decode-step attention on sparta's kernel (``codegen/decode_kernels.py``)."""
    from .codegen.decode_kernels import decode_attention
    choice, module = decode_attention(ctx.graph)
    if ctx.plan is not None:
        ctx.plan.decode.pop("attention", None)        # a plan from the pipeline cache holds none of its own
        if choice is not None:
            ctx.plan.decode["attention"] = choice
            ctx.decode_modules["attention"] = module


def build_model(ctx: CompileContext) -> None:
    from .compiled_model import CompiledModel
    o = ctx.options
    ctx.compiled = CompiledModel(ctx.graph, target=o.target, plan=ctx.plan, replacements=ctx.replacements,
                                 timings=ctx.timings, kernels=ctx.kernels, source=ctx.source, inductor=o.inductor)
    ctx.compiled.from_meta = ctx.meta
    ctx.compiled.decode_modules = dict(ctx.decode_modules)


def measure(ctx: CompileContext) -> None:
    """Sparse ops measured slower than dense run dense (``compile(measure=True)``)."""
    from .dense_fallback import measure_and_fall_back
    measure_and_fall_back(ctx.compiled)


def verify(ctx: CompileContext) -> None:
    ctx.compiled.verify()


PASSES = (
    Pass("capture", capture),
    Pass("attach_tesa", attach),
    Pass("simplify", simplify),
    Pass("fold_bn", fold_bn),
    Pass("conv_as_linear", convs_as_linears, targets=("cuda",)),
    Pass("fuse_siblings", fuse_siblings, targets=("cuda",)),
    Pass("plan_tokens", plan_tokens),
    Pass("target", choose_target),
    Pass("propagate_and_plan", propagate_and_plan, timed=""),   # propagate, calibrate, transform or plan_cache
    Pass("shrink", shrink),
    Pass("formats", choose_formats),
    Pass("dismantle", pin_dismantle, when=lambda o: o.dismantle is not None),
    Pass("select", select),
    Pass("specialize", specialize, timed="codegen"),
    Pass("attention", attention),
    Pass("decode_kernels", decode_kernels, targets=("cuda",)),
    Pass("build", build_model),
    Pass("measure", measure, when=lambda o: o.measure),
    Pass("verify", verify, when=lambda o: o.verify),
)
PASSES_BY_NAME = {p.name: p for p in PASSES}


def run_pass(ctx: CompileContext, p: Pass | str) -> CompileContext:
    """Run one pass (a :class:`Pass` or its name) on ``ctx`` if it applies, timed into ``ctx.timings``."""
    p = PASSES_BY_NAME[p] if isinstance(p, str) else p
    if not p.applies(ctx.options):
        return ctx
    t0 = time.perf_counter()
    p.run(ctx)
    if p.key:
        ctx.timings[p.key] = time.perf_counter() - t0
        if ctx.compiled is not None:            # a pass after the model exists: its timings too
            ctx.compiled.timings[p.key] = ctx.timings[p.key]
    return ctx


def run_passes(ctx: CompileContext, passes=PASSES) -> CompileContext:
    """Run ``passes`` (default: the pipeline) in order on ``ctx``, with a progress bar of the stages
    (``sparta.progress``)."""
    from .progress import bar
    with bar("sparta.compile", len(passes), unit="pass") as progress:
        for p in passes:
            progress.set_postfix_str(p.name)
            run_pass(ctx, p)
            progress.update(1)
    return ctx


def load_compile_target(name: str, profile):
    """The Target ``compile`` plans for: ``name``'s, its cost model replaced by ``profile`` if given; on the CPU
    without one, this machine's (``codegen.profile.host_profile``: measured here on first use where the shipped
    profile is another CPU's)."""
    from .target import load_target
    if profile is None and name == "cpu":
        from .codegen.profile import host_profile
        profile = host_profile()
    try:
        return load_target(name, profile)      # a profile JSON path: its formats too
    except (SpartaError, OSError, ValueError) as exc:       # a missing file, bad JSON, an invalid profile
        raise SpartaError(f"profile {profile!r}: {exc}") from None


__all__ = ["attach_tesa", "CODEGEN", "CompileContext", "CompileOptions", "PASSES", "PASSES_BY_NAME", "Pass", "run_pass",
           "run_passes", "load_compile_target"]
