"""Masks where users keep them: ``torch.nn.utils.prune`` masks and a weight's exact zeros, as TeSAs.

``sparta.compile`` captures a copy of the model in which every pruning is made permanent (so the graph holds one
constant weight, not ``weight_orig * weight_mask``) and attaches each mask as the TeSA of ``<module path>.<name>``,
met with the user's TeSA for that name. The user's model is never modified.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch.nn.utils import prune

from ..errors import CaptureError, GraphError
from ..graph import Graph
from ..tesa import TeSA

MIN_ZERO_FRACTION = 0.10
"""A float weight of 2 or more dimensions whose exact zeros are at least this fraction of it gets them as its TeSA.
Trained or freshly initialised weights hold next to no exact zeros, so a tenth of them is a pruning the user kept
(e.g. after ``prune.remove``); below it no sparse kernel pays, and a TeSA would only add work to every compile."""

FROM_PRUNE = "torch.nn.utils.prune"
FROM_ZEROS = "zeros in the weight"
FROM_USER = "the user"


def find_masks(model):
    """``(module to capture, {parameter name: (TeSA, source)})`` for a torch module (other models pass through).

    Pruned parameters (a ``BasePruningMethod`` forward pre-hook, ``<name>_orig`` and ``<name>_mask``) give their
    mask, read before the pruning is made permanent on a deep copy; other float weights of 2 or more dimensions give
    their exact zeros when these are at least :data:`MIN_ZERO_FRACTION` of them."""
    if not isinstance(model, torch.nn.Module):
        return model, {}
    pruned = pruned_parameters(model)
    if pruned:
        model = _permanent_copy(model, pruned)
    masks = {name: (TeSA.from_mask(mask, name=name), FROM_PRUNE) for name, mask in pruned.items()}
    for name, param in model.named_parameters():
        if name in masks or not param.is_floating_point() or param.ndim < 2 or not param.numel():
            continue
        if 1 - param.count_nonzero().item() / param.numel() >= MIN_ZERO_FRACTION:
            masks[name] = (TeSA.from_mask(param.detach().cpu() != 0, name=name), FROM_ZEROS)
    return model, masks


def pruned_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{"<module path>.<name>": kept elements (bool)}`` of every parameter pruned by ``torch.nn.utils.prune``."""
    found = {}
    for path, module, name in _pruned(model):
        found[f"{path}.{name}" if path else name] = getattr(module, name + "_mask").detach().cpu().bool()
    return found


def _pruned(model: torch.nn.Module):
    """``(module path, module, parameter name)`` of every ``torch.nn.utils.prune`` forward pre-hook in ``model``."""
    for path, module in model.named_modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                yield path, module, hook._tensor_name


def attach_masks(graph: Graph, masks: Mapping, initial_tesa=None) -> Graph:
    """Meet each found mask into the graph's TeSA of its parameter and record where TeSAs came from
    (``graph.meta["mask_sources"]``: source → names). A pruned parameter is also reachable as ``<name>_orig``."""
    sources: dict[str, list[str]] = {}
    for name, (tesa, source) in masks.items():
        try:
            tensor, perm = graph.resolve(name)
        except GraphError:              # a parameter the forward never reads
            continue
        if source == FROM_PRUNE and not _known(graph, name + "_orig"):
            graph.add_alias(name + "_orig", tensor, perm)
        graph.set_tesa(name, graph.tesa(name).meet(tesa.check_shape(graph.tesa(name).shape, name)))
        sources.setdefault(source, []).append(name)
    if isinstance(initial_tesa, Mapping) and initial_tesa:
        sources[FROM_USER] = [str(name) for name in initial_tesa]
    graph.meta["mask_sources"] = sources
    return graph


def mask_sources_line(graph: Graph) -> str:
    """``masks: 2 from torch.nn.utils.prune, 1 from zeros in the weight, 1 from the user`` (or ``masks: none``)."""
    sources = graph.meta.get("mask_sources") or {}
    parts = [f"{len(sources[s])} from {s}" for s in (FROM_PRUNE, FROM_ZEROS, FROM_USER) if sources.get(s)]
    return "masks: " + (", ".join(parts) or "none")


def _known(graph: Graph, name: str) -> bool:
    try:
        graph.resolve(name)
    except GraphError:
        return False
    return True


def _permanent_copy(model: torch.nn.Module, pruned: Mapping) -> torch.nn.Module:
    """A deep copy of ``model`` with every pruning made permanent (``prune.remove``): plain parameters holding
    ``<name>_orig * <name>_mask``."""
    # the pruned weight attribute is computed (not a leaf), which deepcopy refuses: prune.remove replaces it anyway
    memo = {}
    for _, module, name in _pruned(model):
        computed = getattr(module, name, None)
        if isinstance(computed, torch.Tensor):
            memo[id(computed)] = computed.detach()
    try:
        clone = copy.deepcopy(model, memo)
    except Exception as exc:  # noqa: BLE001 - any object deepcopy cannot copy
        raise CaptureError(f"cannot copy the model to make its torch.nn.utils.prune pruning of {sorted(pruned)} "
                           f"permanent ({type(exc).__name__}: {exc}); call prune.remove on them before compiling "
                           "(their zeros are then read from the weights)") from None
    for _, module, name in list(_pruned(clone)):
        prune.remove(module, name)
    return clone


__all__ = ["MIN_ZERO_FRACTION", "find_masks", "pruned_parameters", "attach_masks", "mask_sources_line"]
