"""``compiled.generate()``: a compiled Hugging Face causal LM generating with Hugging Face's loop and cache, every
linear that has a sparta kernel running on it.

The compiled graph is the model's cache-free forward. Generation rebuilds the model from its recorded class and
config (:mod:`sparta.frontend.hf`) and swaps sparta's kernel modules in for the linears the plan gave kernels (the
torchao way): Hugging Face keeps its control flow, KV cache, attention and sampling. Sibling linears the plan stacked
into one kernel share one launch; an activation a kernel computes in its epilogue is taken out of the model; a gated
MLP whose gate, up and product one kernel computes runs as that kernel and the down projection. A linear whose kernel
cannot stand alone (it reads or writes int8 codes another kernel hands over) runs as the model's own linear on the
masked weight, and :func:`swap_report` says so. On a GPU the decode steps replay CUDA graphs
(:class:`DecodeGraphs`, Hugging Face's static cache). See ``docs/generation.md``.
"""

from __future__ import annotations

import contextlib

import torch

from .errors import SpartaError
from .graph import Graph


class GenerationError(SpartaError):
    """The compiled model cannot generate (not a Hugging Face causal LM, or a swap that does not fit)."""


class SharedKernel(torch.nn.Module):
    """One kernel module computing several linears' outputs stacked along N (q/k/v, gate/up): run once per input,
    each of its ``parts`` reading its slice; the output is let go once every part has read it."""

    def __init__(self, kernel: torch.nn.Module, parts: int):
        super().__init__()
        self.kernel, self.parts = kernel, parts
        self._last, self._reads = None, 0

    def part(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self._last is None or self._last[0] is not x:
            self._last, self._reads = (x, self.kernel(x)), 0
        out = self._last[1][..., start:end]
        self._reads += 1
        if self._reads == self.parts:
            self._last = None
        return out


class KernelSlice(torch.nn.Module):
    """Stands in for one of the linears a :class:`SharedKernel` computes: rows ``start:end`` of its output."""

    def __init__(self, shared: SharedKernel, start: int, end: int, out_features: int):
        super().__init__()
        self.shared, self.start, self.end = shared, start, end
        self.out_features = out_features

    def forward(self, x):
        return self.shared.part(x, self.start, self.end)


class KernelLinear(torch.nn.Module):
    """Stands in for a linear (``nn.Linear`` or GPT-2's ``Conv1D``): its kernel module on ``(..., K)`` inputs."""

    def __init__(self, kernel: torch.nn.Module, out_features: int):
        super().__init__()
        self.kernel, self.out_features = kernel, out_features

    def forward(self, x):
        return self.kernel(x)


class GatedKernelMLP(torch.nn.Module):
    """Stands in for a gated MLP (``down(act(gate(x)) * up(x))``) whose gate, up and product one kernel computes."""

    def __init__(self, gated: torch.nn.Module, down_proj: torch.nn.Module):
        super().__init__()
        self.gated, self.down_proj = gated, down_proj      # the model's name: its weight keeps its state_dict name

    def forward(self, x):
        return self.down_proj(self.gated(x))


def decoder(compiled) -> torch.nn.Module:
    """The Hugging Face model rebuilt around ``compiled``'s kernel modules, on the compiled model's device (cached
    on ``compiled``; :func:`swap_report` lists what runs where)."""
    record = compiled.graph.hf_model
    if record is None:
        raise GenerationError("generate() needs a Hugging Face model (compiled from a transformers "
                              "*ForCausalLM); this compiled model has no recorded model class")
    if not record.get("generative"):
        raise GenerationError(f"{record['class']} cannot generate (it has no language-model head): compile its "
                              f"*ForCausalLM class, e.g. {record['class'].removesuffix('Model')}ForCausalLM")
    model, report = _rebuild(compiled, record)
    kernel = compiled.decode_modules.get("attention")
    if kernel is not None:
        from .hf_attention import attach
        kernel.to(compiled.device)
        name = f"{type(kernel).__name__} at one-token steps over the cache ({kernel.spec.name.rsplit('_', 1)[0]}" \
               "{}); else torch SDPA"
        report += [(path, name.format(" with the rotary embedding and cache write" if rope else ""))
                   for path, rope in attach(model, kernel)]
    model.sparta_swaps = report
    return model.to(compiled.device)


def swap_report(model) -> list[tuple[str, str]]:
    """``(module path, what runs it)`` for every linear of a :func:`decoder` model, and its attention modules where
    the decode steps run sparta's decode-attention kernel."""
    return list(getattr(model, "sparta_swaps", []))


def _rebuild(compiled, record: dict):
    from .compiled_model import MaskedWeights
    from .frontend.hf import model_class, model_config
    graph: Graph = compiled.graph
    cls, config = model_class(record["class"]), model_config(record)
    with _parameters_on_meta():
        model = cls(config)
    model.eval()
    swaps, report = _swaps(compiled, model)
    for path, module in swaps.items():
        _set_module(model, path, module)
    masked = MaskedWeights(graph)
    missing = []
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        value = _weight(graph, name, masked)
        if value is None:
            missing.append(name)
            continue
        owner, leaf = _owner(model, name)
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    if missing:
        raise GenerationError(f"the compiled model holds no value for {len(missing)} parameters of "
                              f"{record['class']} ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
    for name, buf in list(model.named_buffers()):
        if graph.has_tensor(name) and graph.tensor(name).data is not None:     # the captured model's own values
            owner, leaf = _owner(model, name)
            owner._buffers[leaf] = graph.tensor(name).data.to(buf.dtype)
    return model, report


def _value(graph: Graph, masked, name: str) -> torch.Tensor | None:
    """A weight's value with its pruned elements zero (``masked``: the graph's :class:`MaskedWeights`)."""
    return masked[name] if name in masked.names else graph.tensor(name).data


def _weight(graph: Graph, name: str, masked) -> torch.Tensor | None:
    """A parameter's value in the compiled graph (its pruned elements zero): by name, alias or stacked part."""
    try:
        target, perm = graph.resolve(name)
    except SpartaError:
        target, perm = None, None
    if target is not None:
        value = _value(graph, masked, target)
        return None if value is None else value if perm is None else value.permute(perm).contiguous()
    for stacked, parts in graph.stacked_weights.items():
        for part, start, end in parts:
            if part == name and graph.has_tensor(stacked):
                value = _value(graph, masked, stacked)
                return None if value is None else value[start:end].clone()
    return None


def _swaps(compiled, model) -> tuple[dict[str, torch.nn.Module], list[tuple[str, str]]]:
    """The kernel modules standing in for the model's linears (by module path), and the report."""
    graph, plan = compiled.graph, compiled.plan
    kernels = compiled.module_replacements()
    groups = {g.anchor: g for g in getattr(plan, "fusions", [])} if plan is not None else {}
    readers = {r for g in groups.values() for r in g.readers}
    swaps, report = {}, []
    for op in graph.ops():
        weight = op.input_of("weight") if op.op == "linear" else _mm_weight(graph, op)
        if weight is None:
            continue
        parts = graph.stacked_weights.get(weight) or [[weight, 0, None]]
        paths = [_module_path(p) for p, _, _ in parts]
        if not all(_has_module(model, p) for p in paths):
            continue
        kernel = kernels.get(op.name)
        why = _why_not(op, kernel, groups.get(op.name), readers)
        if why:
            report += [(p, f"torch linear on the masked weight: {why}") for p in paths]
            continue
        group = groups.get(op.name)
        name = type(kernel).__name__
        if group is not None and group.kind == "epilogue" and len(group.ops) > 1:    # a gated unit
            mlp = _gated_mlp(model, paths, group, graph)
            if mlp is None:
                report += [(p, "torch linear on the masked weight: its kernel computes a gated product this "
                               "model's MLP does not expose") for p in paths]
                continue
            swaps[mlp] = GatedKernelMLP(kernel, _get_module(model, f"{mlp}.down_proj"))
            report += [(p, f"{name} (gated: {', '.join(group.ops)} in its epilogue)") for p in paths]
            continue
        if group is not None and group.kind == "epilogue":
            act = _activation_module(model, graph.op(group.ops[0]))
            if act is None:
                report += [(p, f"torch linear on the masked weight: its kernel computes {group.ops[0]}, which "
                               "the model does not apply as a module of its own") for p in paths]
                continue
            swaps[act] = torch.nn.Identity()
        if len(parts) == 1:
            swaps[paths[0]] = KernelLinear(kernel, _out_features(model, paths[0]))
            report.append((paths[0], name))
        else:
            shared = SharedKernel(kernel, len(parts))
            for (part, start, end), path in zip(parts, paths):
                swaps[path] = KernelSlice(shared, start, end, end - start)
                report.append((path, f"{name} (stacked: {'+'.join(p.rsplit('.', 2)[-2] for p, _, _ in parts)})"))
    return swaps, report


def _why_not(op, kernel, group, readers) -> str:
    """Why a linear's kernel module cannot stand in for the model's linear ('' where it can)."""
    if kernel is None:
        return "the plan runs it dense"
    x = op.input_of("input") or op.input_of("mat1") or (op.input_of("self") if op.op == "mm" else None)
    if list(getattr(kernel, "input_names", [])) != [x]:
        return "its kernel reads int8 codes another kernel writes"
    if getattr(kernel, "output_names", None) and not (group is not None and group.kind == "epilogue"):
        return "its kernel writes int8 codes for the next kernel"
    if op.name in readers or (group is not None and group.kind != "epilogue"):
        return "its kernel is fused with its neighbours' (int8 hand-off)"
    return ""


def _mm_weight(graph: Graph, op) -> str | None:
    """The weight of an ``addmm``/``mm`` computing ``x · W`` with a parameter ``W`` (GPT-2's ``Conv1D``)."""
    if op.op not in ("addmm", "mm") or len(op.inputs) < 2:
        return None
    w = op.inputs[-1]
    return w if graph.has_tensor(w) and graph.tensor(w).kind == "weight" else None


def _gated_mlp(model, paths: list[str], group, graph) -> str | None:
    """The MLP module whose ``gate_proj``/``up_proj`` are the stacked parts and that has a ``down_proj`` (None: not
    one this swap knows)."""
    parents = {p.rsplit(".", 1)[0] for p in paths}
    if len(parents) != 1 or sorted(p.rsplit(".", 1)[1] for p in paths) != ["gate_proj", "up_proj"]:
        return None
    mlp = parents.pop()
    return mlp if _has_module(model, f"{mlp}.down_proj") else None


def _activation_module(model, act_op) -> str | None:
    """The path of the module that applies activation op ``act_op`` alone (an ``act_fn`` module), or None."""
    path = act_op.source.split(" ", 1)[0] if act_op.source else ""
    if not path or not _has_module(model, path):
        return None
    module = _get_module(model, path)
    if any(True for _ in module.parameters()) or any(True for _ in module.children()):
        return None
    return path


def _module_path(weight: str) -> str:
    return weight.rsplit(".", 1)[0] if "." in weight else ""


def _get_module(model, path: str):
    return model.get_submodule(path) if path else model


def _has_module(model, path: str) -> bool:
    try:
        _get_module(model, path)
    except AttributeError:
        return False
    return bool(path)


def _out_features(model, path: str) -> int:
    m = _get_module(model, path)
    return int(getattr(m, "out_features", None) or getattr(m, "nf", 0))


def _set_module(model, path: str, module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(_get_module(model, parent), leaf, module)


def _owner(model, name: str):
    parent, _, leaf = name.rpartition(".")
    return _get_module(model, parent), leaf


@contextlib.contextmanager
def _parameters_on_meta():
    """Build a model with its parameters on the meta device (no memory, no initialisation) and its buffers
    (rotary frequencies, position ids) computed as the model's own code computes them."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)
    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def generate(compiled, *args, **kwargs):
    """``compiled.generate``: Hugging Face's ``generate`` on :func:`decoder`; on a GPU with a static cache (unless a
    cache or cache implementation is given) and each decode step replayed from a CUDA graph — a plain greedy call
    runs :func:`sparta.runtime.decode_loop.greedy_generate` (one graph per token, forward to next input)."""
    from .runtime import decode_loop
    from .runtime.decode_graphs import DecodeGraphs
    model = compiled.decoder()
    if model.device.type == "cuda" and decode_loop.supports(args, kwargs):
        with torch.no_grad():
            return decode_loop.greedy_generate(model, *args, **kwargs)
    if model.device.type == "cuda":
        if not any(k in kwargs for k in ("cache_implementation", "past_key_values", "cache")) \
                and kwargs.get("use_cache", True):
            kwargs["cache_implementation"] = "static"
        if getattr(model, "sparta_decode_graphs", None) is None:
            model.sparta_decode_graphs = DecodeGraphs(model)
            model.get_compiled_call = lambda *_: model.sparta_decode_graphs
    with torch.no_grad():
        return model.generate(*args, **kwargs)
