"""CompiledModel: what ``sparta.compile`` returns: the graph run with sparta's kernels, its reports and checks."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils import _pytree as pytree

from .errors import SpartaError
from .graph import Graph
from .runtime.inductor import compiled_runner, inductor_mode
from .sampling import random_inputs, verification_sizes
from .tesa import TeSA
from .text import table


def refuse_meta(what: str) -> None:
    from .meta_model import refuse
    refuse(what)


class VerificationError(SpartaError):
    """The compiled model disagrees with its dense reference."""


def reference_weight(module) -> torch.Tensor | None:
    """The weight a kernel module applies, for the dense reference (None: the graph's masked weight): the one it
    holds, or, for a module with a ``reference_dtype``, its packed weights dequantised (``graph_weight()``) in that
    dtype, rebuilt on each read (a large quantised model's are never all held)."""
    ref = getattr(module, "reference_weight", None)
    if ref is not None:
        return ref
    dtype = getattr(module, "reference_dtype", None)
    return None if dtype is None else module.graph_weight().to(dtype)


def has_reference(module) -> bool:
    """Whether the dense reference applies ``module``'s own weight (:func:`reference_weight`)."""
    return getattr(module, "reference_weight", None) is not None or getattr(module, "reference_dtype", None) is not None


class MaskedWeights(Mapping):
    """Weights with their pruned elements zeroed (the dense reference's weights), by name, each computed when read
    (a large model's are never all held); ``overrides`` are given values, or kernel modules whose
    :func:`reference_weight` is read when asked for."""

    def __init__(self, graph: Graph, overrides: Mapping | None = None):
        self.graph, self.overrides = graph, dict(overrides or {})
        self.names = list(dict.fromkeys([v.name for v in graph.tensors("weight")
                                         if v.has_data and not v.tesa.is_dense] + list(self.overrides)))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.overrides:
            given = self.overrides[name]
            return given if isinstance(given, torch.Tensor) else reference_weight(given)
        if name not in self.names:
            raise KeyError(name)
        v = self.graph.tensor(name)
        return v.tesa.apply(v.data)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def masked_weights(graph: Graph) -> MaskedWeights:
    """Weights with their pruned elements zeroed (the dense reference's weights), computed as they are read."""
    return MaskedWeights(graph)


class CompiledModel(torch.nn.Module):
    """A model compiled by sparta: call it like the original module, for inference. Its kernels compute no
    gradients, so a call with grad mode on and an input that requires grad is refused (rather than returning
    outputs cut off from autograd): call it under ``torch.no_grad()``, or with inputs that do not require grad."""

    from_meta = False        # compiled from a meta-device model: no weights (``sparta.meta_model``)
    decode_modules: dict = {}   # kernels only generate()'s decode steps run, by what (``codegen/decode_kernels.py``)

    def __init__(self, graph: Graph, *, target: str = "cpu", plan=None, replacements=None, timings=None,
                 kernels=None, source: Graph | None = None, inductor: str | None = None):
        super().__init__()
        self.graph = graph
        self.source_graph = source
        self.target = target
        self.plan = plan
        self.timings = dict(timings or {})
        self.kernels = list(kernels or [])
        self.quantization = graph.quantization   # the calibration report, if one ran
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
        self.module = to_graph_module(self.graph, masked_weights(self.graph), self._replacements,
                                      channels_last=self.target == "cpu")
        if device is not None:
            self.module.to(device)
        # the reference sees what the kernels really apply: quantised weights dequantised
        self._reference_weights = MaskedWeights(self.graph, {
            m.weight_name: m for m in self._replacements.values() if has_reference(m)})
        self._quantized = any(k.get("bits", "W32A32") != "W32A32" for k in self.kernels)
        self._reference, self._inductor_fn, self._decoder = None, None, None

    def run_dense(self, ops, why: str = "asked for") -> list[str]:
        """Run these sparse ops as their dense torch ops (their fused activations too); the plan says so, with
        ``why``. ``compiled.run_dense(compiled.profile().slower_than_dense(), "measured slower")`` closes the loop."""
        from .dense_fallback import run_dense
        return run_dense(self, dict.fromkeys(ops, why))

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
        self._inductor, self._inductor_fn = run_mode(mode, self.target), None

    def _run(self, flat):
        """The fx module on the graph's flat inputs, through torch.compile where ``inductor`` says."""
        if self._inductor is None or self.device.type != self.target:
            return self.module(*flat)
        if self._inductor_fn is None:
            self._inductor_fn = compiled_runner(self.module, self._inductor)
        return self._inductor_fn(*flat)

    def forward(self, *args, **kwargs):
        if self.from_meta:
            refuse_meta("calling it")
        if torch.compiler.is_compiling():   # Dynamo guards the shapes itself: take the inputs as they come
            outs = self.module(*self.graph.flat_inputs(args, kwargs, check=False))
        else:
            flat = self.graph.flat_inputs(args, kwargs)
            check_inference_inputs(flat)
            outs = self._run(flat)
        out_spec = self.graph.meta.get("out_spec")
        return pytree.tree_unflatten(list(outs), out_spec) if out_spec is not None else outs

    def tesa(self, name: str) -> TeSA:
        return self.graph.tesa(name)

    def module_replacements(self) -> dict[str, torch.nn.Module]:
        """The kernel modules standing in for graph ops, by op name."""
        return dict(self._replacements)

    def save(self, path, weights: bool = True) -> str:
        """Write the model (graph, plan, weights, kernels) to the folder ``path``; reload with ``sparta.load``.
        ``weights=False`` writes no weight values (plan, kernels and masks only): ``sparta.load(path, weights=...)``
        takes them from the user's checkpoint (the only save of a model compiled from the meta device)."""
        from .saved import save
        if self.from_meta and weights:
            refuse_meta("save(dir) with weights")
        return str(save(self, path, weights=weights))

    def decoder(self) -> torch.nn.Module:
        """The Hugging Face model this was compiled from, rebuilt around sparta's kernel modules (for
        :meth:`generate`; ``sparta.generation.swap_report(compiled.decoder())`` lists what runs each linear)."""
        from .generation import decoder
        if self._decoder is None or self._decoder.device != self.device:
            self._decoder = decoder(self)
        return self._decoder

    def generate(self, *args, **kwargs):
        """Hugging Face's ``generate()`` (same arguments) over sparta's kernels, with its KV cache; on a GPU the cache
        is static and decode steps replay CUDA graphs. For compiled ``*ForCausalLM`` models."""
        if self.from_meta:
            refuse_meta("generate()")
        from .generation import generate
        return generate(self, *args, **kwargs)

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
        captured with dynamic dimensions is checked at three shapes at least (the example's, one row, larger), inputs
        that share a dimension drawn at one size; masks are drawn right-padded at random, lengths up to the sequence
        (:func:`sparta.sampling.random_inputs`).

        Two checks per trial: the propagated TeSAs against the model with only the user's initial TeSAs
        (both as plain torch ops on masked fp weights: propagation may prune only what cannot change an
        output), and the kernels against the propagated graph (masked, quantised weights as the kernels
        apply them). Returns the worst relative error of each output against the model as given."""
        if self.from_meta:
            refuse_meta("verify()")
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
        if self.from_meta:
            refuse_meta("profile()")
        from .profiling import profile
        if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
            raise SpartaError(f"profile: reps is the number of forwards to time, a whole number >= 1; got {reps!r}")
        if args or kwargs:
            check_inference_inputs(self.graph.flat_inputs(args, kwargs))
        return profile(self, args, kwargs, reps)

    def plan_report(self, only_gemm: bool = False) -> str:
        """The execution plan as a table: op, density, bits, chosen blocks, estimated µs, dense µs."""
        if self.plan is None:
            return "no plan"
        from .frontend.prune_masks import mask_sources_line
        masks = "\n" + mask_sources_line(self.graph) if "mask_sources" in self.graph.meta else ""
        return self.plan.report(only_gemm) + "\n" + self.shapes_line() + masks

    def shapes_line(self) -> str:
        """The input shapes the model takes, and the token range its plan was costed over."""
        from .shapes import shapes_line
        return shapes_line(self.graph)

    def kernel_report(self) -> str:
        """The compiled kernels: op, template, blocks, bits, dismantle level, build time, cache, code size."""
        if not self.kernels:
            return "no sparta kernels (every op runs as a torch op)"
        text = kernel_table(self.kernels)
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


def run_mode(inductor, target: str) -> str | None:
    """:func:`inductor_mode`, refusing CUDA graph replay for a CPU model (it would fail on its first call)."""
    mode = inductor_mode(inductor, target)
    if mode == "cudagraph" and target != "cuda":
        raise SpartaError(f"inductor='cudagraph' replays CUDA graphs, which a {target} model cannot: compile with "
                          "target='cuda', or pass inductor=True (Inductor's default mode), another torch.compile mode "
                          "such as 'max-autotune-no-cudagraphs', or False")
    return mode


def check_inference_inputs(flat: list[torch.Tensor]) -> None:
    """Refuse inputs the compiled model cannot run: meta tensors (no data) and, with grad mode on, inputs that
    require grad (the kernels compute no gradients: the outputs would be cut off from autograd)."""
    for x in flat:
        if x.device.type == "meta":
            raise SpartaError("an input is on the meta device, which holds no data: pass real tensors on the "
                              "model's device")
    if torch.is_grad_enabled() and any(x.requires_grad for x in flat):
        raise SpartaError("an input requires grad, but sparta kernels are inference-only (they compute no "
                          "gradients): call the model under torch.no_grad() or torch.inference_mode(), or with "
                          "inputs that do not require grad (x.detach())")


def kernel_table(kernels: list[dict]) -> str:
    """The kernel report's table of kernel rows (a compiled model's, or a saved manifest's)."""
    cols = ("op", "template", "blocks", "bits", "dismantle", "build_s", "cached", "code_bytes")
    return table([cols] + [tuple(str(k.get(c, "")) for c in cols) for k in kernels])


def _tolerance(dtype, rtol, atol):
    defaults = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-4, 1e-5)}
    r, a = defaults.get(dtype, (0.0, 0.0))
    return (r if rtol is None else rtol), (a if atol is None else atol)
