"""Decode steps replayed from CUDA graphs: what ``generate()`` calls in place of Hugging Face's compiled forward.

Hugging Face's ``generate`` runs each decode step through ``model.get_compiled_call(...)`` when the cache is static
(fixed addresses). :class:`DecodeGraphs` is that call: each step signature (the tensors' shapes and dtypes, the cache
object) is captured once into a ``torch.cuda.CUDAGraph`` and replayed with the step's inputs copied in, so a step
costs the host one launch instead of one per kernel. The 2-d padding mask, which grows by one each step, goes in as
a 4-d mask over the whole static cache (what the model would have built from it; some transformers releases pass that
4-d mask already), so every step of a generation has one shape. Prefill and any call this cannot replay (no static cache, several tokens, not on a GPU) run eagerly.
"""

from __future__ import annotations

import torch


def max_cache_length(cache) -> int | None:
    """The number of positions a static cache holds (None: not a cache of fixed length this can read)."""
    for name in ("get_max_length", "get_max_cache_shape"):       # the name of newer transformers first
        fn = getattr(cache, name, None)
        if callable(fn):
            try:
                n = fn()
            except Exception:  # noqa: BLE001 - cache APIs differ between transformers releases
                continue
            if isinstance(n, int) and n > 0:
                return n
    n = getattr(cache, "max_cache_len", None)
    return n if isinstance(n, int) and n > 0 else None


def full_mask(model, mask: torch.Tensor, length: int) -> torch.Tensor:
    """The 4-d mask ``(B, 1, 1, length)`` of a one-token step over a static cache of ``length`` positions: the keys the
    2-d ``mask`` keeps, up to its length; boolean for SDPA (and sparta's), additive in the model's dtype for other
    attention."""
    full = torch.zeros(mask.shape[0], length, dtype=torch.bool, device=mask.device)
    full[:, : mask.shape[1]] = mask.bool()
    return attention_mask(model, full[:, None, None, :])


def attention_mask(model, keep: torch.Tensor) -> torch.Tensor:
    """A 4-d mask of kept keys (bool) as the model's attention takes it: boolean for SDPA, additive in the model's
    dtype otherwise."""
    if getattr(model.config, "_attn_implementation", "sdpa") in ("sdpa", "sparta"):
        return keep
    dtype = model.dtype
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def _cache_state(cache) -> list[torch.Tensor]:
    """The cache's small device tensors (lengths, counters) that a forward advances in place."""
    out = []
    for layer in getattr(cache, "layers", None) or []:
        for v in vars(layer).values():
            if isinstance(v, torch.Tensor) and v.numel() <= 64:
                out.append(v)
    return out


class DecodeGraphs:
    """Hugging Face's compiled-call hook for a model on a GPU: one CUDA graph per decode-step signature."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.graphs: dict = {}
        self.replays = 0
        self.fallbacks = 0         # calls run eagerly (prefill, or a step this cannot replay)

    def __call__(self, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        ids = kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        length = max_cache_length(cache) if cache is not None else None
        if not (isinstance(ids, torch.Tensor) and ids.is_cuda and ids.dim() == 2 and ids.shape[1] == 1
                and length is not None and isinstance(mask, torch.Tensor)
                and (mask.dim() == 2 and mask.shape[1] <= length or mask.dim() == 4 and mask.shape[-1] == length)):
            self.fallbacks += 1
            return self.model(**kwargs)
        if mask.dim() == 2:        # some transformers releases build the 4-d mask themselves for a static cache
            kwargs = dict(kwargs, attention_mask=full_mask(self.model, mask, length))
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in kwargs.items() if k not in tensors}
        key = (tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(tensors.items())),
               tuple((k, id(v) if not isinstance(v, (bool, int, str, type(None))) else v)
                     for k, v in sorted(others.items())))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(tensors, others)
        graph, static, out = entry
        for k, v in tensors.items():
            static[k].copy_(v)
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, tensors: dict, others: dict):
        static = {k: v.clone() for k, v in tensors.items()}
        cache = others.get("past_key_values", others.get("cache"))
        state = [(t, t.clone()) for t in _cache_state(cache)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():       # warm-up: lazy allocations happen outside the graph
            self.model(**static, **others)
        torch.cuda.current_stream().wait_stream(side)
        for t, before in state:                               # the warm-up step must not count as a step
            t.copy_(before)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = self.model(**static, **others)
        return graph, static, out
