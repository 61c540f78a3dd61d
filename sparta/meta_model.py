"""Compiling a model whose parameters are on the meta device: kernels from masks, bits and shapes, no checkpoint.

Block-sparse kernels depend on the masks (block positions), the bits and the shapes, never on weight values, so a model
created under ``torch.device("meta")`` compiles: capture, propagation, planning, selection and kernel builds run.
What needs values is refused with a :class:`MetaModelError` that says what to do: verification, calibration,
measurement, the exact-zero and ``torch.nn.utils.prune`` mask discovery, and running or fully saving the result. A
weight whose kept elements are all at 4 bits needs no values to pick its kernels: its plan records the scale scheme
without clip ratios, and the load fits them to the checkpoint by the rule a compile with the weights uses
(``WeightQuant.params``); other widths below 16 bits are refused. Such a model is saved kernels-only
(``save(dir, weights=False)``) and loaded with ``sparta.load(dir, weights=checkpoint)``.

Buffers are values the folder keeps (rotary frequencies, ...): a meta buffer of a module that rebuilds itself from its
``config`` (Hugging Face's rotary embeddings) is computed again on the CPU; any other one the graph reads is refused.
"""

from __future__ import annotations


import torch

from .errors import SpartaError

LOAD_HINT = "load it with sparta.load(dir, weights=checkpoint)"


class MetaModelError(SpartaError):
    """Something that needs weight values was asked of a model compiled from the meta device."""


def is_meta_model(model) -> bool:
    """Whether ``model`` is a torch module with a parameter on the meta device."""
    return isinstance(model, torch.nn.Module) and any(p.is_meta for p in model.parameters())


def check_options(options) -> None:
    """Refuse the compile options that need weight values."""
    needs = [(options.verify, "verify=True (it runs the dense reference on the weights)"),
             (options.quantize is not None, "calibration (bit widths are chosen from the weights' values)"),
             (options.measure, "measure=True (it times the ops on the weights)")]
    for asked, what in needs:
        if asked:
            raise MetaModelError(f"the model's parameters are on the meta device: {what} needs real weights; compile "
                                 "without it, save with weights=False and " + LOAD_HINT + ", or compile the model "
                                 "with its checkpoint loaded")


def prepare(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The values of ``model``'s meta buffers whose module rebuilds itself from its ``config`` (Hugging Face's rotary
    embeddings), computed on the CPU by name; ``torch.nn.utils.prune`` hooks refused (their masks hold no positions).
    The model is captured as it is (all on meta, so its ops move nothing between devices) and left unchanged."""
    from .frontend.prune_masks import _pruned
    if pruned := [f"{path}.{name}" if path else name for path, _, name in _pruned(model)]:
        raise MetaModelError(f"{pruned[:3]} are pruned by torch.nn.utils.prune on the meta device, whose masks hold no "
                             "positions: pass the masks to sparta.compile as TeSAs or bool masks instead")
    values = {}
    for path, module in model.named_modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            for name, value in _rebuilt_buffers(module).items():
                values[f"{path}.{name}" if path else name] = value
    return values


def _rebuilt_buffers(module) -> dict[str, torch.Tensor]:
    """The buffers of a CPU copy of ``module`` built again from its ``config``, where it has no parameters."""
    config = getattr(module, "config", None)
    if config is None or any(True for _ in module.parameters(recurse=False)):
        return {}
    try:
        with torch.device("cpu"):
            fresh = type(module)(config)
    except Exception:  # noqa: BLE001 - a module that does not rebuild so: its buffers are refused after capture
        return {}
    own = {n: b for n, b in module.named_buffers(recurse=False)}
    return {n: b.to(own[n].dtype) for n, b in fresh.named_buffers(recurse=False)     # (the model's .to(dtype))
            if n in own and b.shape == own[n].shape}


def fill_buffers(graph, values: dict[str, torch.Tensor]) -> None:
    """Put the rebuilt buffers' values in the graph; refuse a graph reading any other meta buffer or constant (the
    folder keeps their values; a checkpoint holds weights)."""
    for value in graph.tensors("weight"):
        if not value.has_data or not value.data.is_meta or value.is_parameter:
            continue
        if value.name not in values:
            raise MetaModelError(f"buffer {value.name!r} is on the meta device: sparta keeps buffers' values in the "
                                 "saved folder, so it needs them at compile; create it on the CPU (e.g. "
                                 "module.register_buffer(name, values)) before compiling")
        value.data = values[value.name]


LOAD_BITS = {"cpu": (4,), "cuda": (4, 8)}   # the widths whose scales a load fits to the checkpoint (no calibration):
#                                            int4; on CUDA also 8 bits beside 16-bit activations (FP8 weights)


def check_bits(graph, target: str = "cpu") -> None:
    """Refuse a meta weight whose TeSA keeps elements at fewer than 16 bits, unless it keeps every one at a width of
    ``LOAD_BITS[target]`` (its scales are fitted at load): other quantised weights' scales or widths are chosen from
    their values."""
    widths = LOAD_BITS.get(target, LOAD_BITS["cpu"])
    for value in graph.tensors("weight"):
        if value.has_data and value.data.is_meta and value.is_parameter:
            kept = {b for b in value.tesa.bit_histogram() if b}         # (per block or one value where held so)
            low = sorted(b for b in kept if b < 16)
            if low and not any(kept == {b} for b in widths):
                raise MetaModelError(f"{value.name!r} keeps elements at {low[0]} bits: a quantised weight's "
                                     "scales are fitted to its values, so it needs real weights unless every kept "
                                     f"element is at one width of {' or '.join(map(str, widths))} bits on {target} "
                                     "(fitted at load); compile the meta model at those widths or 16 bits and more, "
                                     "or compile the model with its checkpoint loaded")


def meta_weight(graph, op) -> torch.Tensor | None:
    """A meta ``(N, K)`` stand-in for a GEMM's weight on the meta device (None where it has values): what a low-bit
    build packs into placeholders of the right shapes (a kernels-only save stores none of them)."""
    from .passes.gemm import gemm_view
    view = gemm_view(graph, op)
    value = graph.tensor(view[1])
    parts = getattr(value, "parts", None)
    meta = parts[0].is_meta if parts else value.has_data and value.data.is_meta
    return torch.empty(view[4], view[5], device="meta") if meta else None


def refuse(what: str) -> None:
    """The error for ``what`` (running, a save with weights, ...) on a model compiled from the meta device."""
    raise MetaModelError(f"{what}: compiled from a meta-device model, it holds no weights: save it with "
                         f"save(dir, weights=False) and {LOAD_HINT}")




def devices_to_cpu(graph) -> None:
    """Ops that create tensors on the device of a meta parameter's result (``arange(device=x.device)``) create them on
    the CPU, as in the model's capture with its weights (the compiled model moves them to its own device)."""
    def fix(v):
        if isinstance(v, torch.device) and v.type == "meta":
            return torch.device("cpu")
        if isinstance(v, (list, tuple)):
            return type(v)(fix(x) for x in v)
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        return v
    for op in graph.ops():
        op.args, op.kwargs, op.attrs = fix(op.args), fix(op.kwargs), fix(op.attrs)


__all__ = ["MetaModelError", "is_meta_model", "check_options", "prepare", "fill_buffers", "devices_to_cpu",
           "check_bits", "meta_weight", "refuse", "LOAD_BITS"]
