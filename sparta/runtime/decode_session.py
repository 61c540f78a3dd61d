"""Greedy generation that owns its static cache, prefill graphs and step graph across calls (gpt-fast's way).

A plain greedy ``generate()`` call pays, besides its tokens, for the prefill (eager: host-bound at 32 layers), the
first decode step, compiling and capturing the step: at 7B about as much as 70 tokens. A :class:`DecodeSession`,
kept on the model per batch size, holds one static cache and reuses it: the prompt is padded on the right to a bucket
of lengths (:func:`prompt_bucket`) and prefilled by one CUDA-graph replay per bucket, the padding's cache slots hidden
by the mask until decode steps overwrite them; the decode steps replay the step graph the first call captured
(:class:`~sparta.runtime.decode_loop.StepLoop`). The model's own forward runs every step with the arguments
transformers' static cache takes (``attention_mask`` as a 4-d mask over the whole cache, positions, the cache), so
the tokens are Hugging Face's greedy tokens. Models whose forward does not take those arguments, or whose layers need
masks of their own (sliding windows), run the recorded-step loop instead (:func:`supports_session`).
"""

from __future__ import annotations

import inspect

import torch

from .decode_graphs import _cache_state, attention_mask

CAPACITY_STEP = 64          # the static cache's length is a multiple of this (one step graph serves nearby lengths)


def prompt_bucket(length: int) -> int:
    """The length a prompt is prefilled at on a GPU: the next power of two from 16, then the next multiple of 512."""
    if length <= 512:
        return max(16, 1 << (length - 1).bit_length())
    return -(-length // 512) * 512


def forward_names(model) -> dict | None:
    """The forward arguments a session passes (the cache's name differs between transformers releases), or None
    where the model cannot run a session's steps."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    cache = next((n for n in ("past_key_values", "cache") if n in params), None)
    config = getattr(model, "config", None)
    windows = {"sliding_attention", "chunked_attention"} & set(getattr(config, "layer_types", None) or ())
    if cache is None or not {"input_ids", "attention_mask", "position_ids", "use_cache"} <= set(params) or windows \
            or getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    return {"cache": cache, "cache_position": "cache_position" in params,
            "logits_to_keep": "logits_to_keep" in params}


def supports_session(model, ids: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return forward_names(model) is not None and (mask is None or mask.shape == ids.shape)


def step_mask(model, keep: torch.Tensor, rows: int) -> torch.Tensor:
    """The 4-d mask ``(B, 1, rows, length)`` of ``rows`` queries at cache positions ``0..rows-1`` over a static cache:
    causal, keys ``keep`` (``(B, length)`` bool) allows, and each query's own key (a padding query sees at least
    itself: no row without a key, no NaN written to the cache); boolean for SDPA, additive otherwise."""
    length = keep.shape[1]
    pos = torch.arange(length, device=keep.device)
    causal = pos[:rows, None] >= pos[None, :]
    full = (causal[None] & keep[:, None, :]) | (pos[:rows, None] == pos[None, :])[None]
    return attention_mask(model, full[:, None])


class _Prefill:
    """Static inputs of one prefill length and, on a GPU, its graph: the forward and the next token."""

    def __init__(self, session: "DecodeSession", rows: int):
        s, dev, batch = session, session.device, session.batch
        self.session, self.rows = s, rows
        self.ids = torch.zeros(batch, rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, rows, dtype=torch.long, device=dev)
        self.mask = step_mask(s.model, torch.ones(batch, s.capacity, dtype=torch.bool, device=dev), rows)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)          # the prompt's last position
        self.next = torch.zeros(batch, dtype=torch.long, device=dev)
        self.graph = None
        self.inductor_error = None

    def fill(self, ids: torch.Tensor, keep: torch.Tensor | None) -> None:
        batch, length = ids.shape
        dev = ids.device
        self.ids.zero_()
        self.ids[:, :length] = ids
        cache_keep = torch.zeros(batch, self.session.capacity, dtype=torch.bool, device=dev)
        cache_keep[:, :self.rows] = True
        if keep is None:
            self.positions.copy_(torch.arange(self.rows, device=dev).expand(batch, -1))
        else:                       # Hugging Face's positions of a left-padded row: its kept tokens counted
            cache_keep[:, :length] = keep.bool()
            real = (keep.long().cumsum(-1) - 1).clamp(min=0)
            tail = real[:, -1:] + torch.arange(1, self.rows - length + 1, device=dev)
            self.positions.copy_(torch.cat([real, tail], 1))
        self.mask.copy_(step_mask(self.session.model, cache_keep, self.rows))
        self.last.fill_(length - 1)

    def forward(self, model=None) -> None:
        s = self.session
        model = s.model if model is None else model
        kw = {"input_ids": self.ids, "attention_mask": self.mask, "position_ids": self.positions,
              s.names["cache"]: s.cache, "use_cache": True}
        if s.names["cache_position"]:
            kw["cache_position"] = torch.arange(self.rows, device=self.ids.device)
        if s.names["logits_to_keep"]:
            kw["logits_to_keep"] = self.last
            logits = model(**kw).logits[:, -1]
        else:
            logits = model(**kw).logits.index_select(1, self.last)[:, 0]
        self.next.copy_(logits.argmax(-1))

    def run(self, graphs: bool, inductor: bool = False) -> None:
        """The prefill: a replay of its graph, or the first time the forward run eagerly (lazy allocations happen
        here) and captured. ``inductor``: the captured forward goes through ``torch.compile`` (the step's compiled
        model: Inductor fuses the norms, rotary embedding and residual adds of the prompt's rows), run once for real
        from the same cache counters first; eager where that fails."""
        if self.graph is not None:
            self.graph.replay()
            return
        cache = self.session.cache
        start = [t.clone() for t in _cache_state(cache)]
        self.forward()                                         # eager the first time: lazy allocations happen here
        forward = self.forward
        if inductor:
            from .decode_loop import compiled_step
            done = [t.clone() for t in _cache_state(cache)]
            _set(cache, start)                                 # the same slots again, from the same counters
            try:
                self.forward(compiled_step(self.session.model))
                forward = lambda: self.forward(compiled_step(self.session.model))  # noqa: E731
            except Exception as exc:  # noqa: BLE001 - Dynamo and Inductor fail in many ways: keep the eager prefill
                import warnings
                self.inductor_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                warnings.warn(f"sparta generate: the prefill runs without torch.compile ({self.inductor_error})",
                              stacklevel=3)
                _set(cache, done)
        if graphs:
            state = [t.clone() for t in _cache_state(cache)]
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):                 # recorded, not run: the cache stays as it is
                forward()
            _set(cache, state)


class DecodeSession:
    """One static cache of ``capacity`` positions for ``batch`` rows, its prefill graphs and its step loop."""

    def __init__(self, model, batch: int, capacity: int, device: torch.device, graphs: bool):
        from transformers import StaticCache
        self.model, self.batch, self.capacity, self.device = model, batch, capacity, device
        self.graphs = graphs
        self.buckets = graphs             # prompts padded to a bucket of lengths (a graph per bucket)
        self.names = forward_names(model)
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.prefills: dict[int, _Prefill] = {}
        self.loops: dict = {}             # (end-of-sequence ids, pad id, through Inductor) -> StepLoop

    def prefill(self, ids: torch.Tensor, keep: torch.Tensor | None,
                inductor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the prompt into the cache; returns (the first new token per row, each row's next position).
        ``inductor``: a bucket's first prefill compiles the forward it captures (see :meth:`_Prefill.run`)."""
        length = ids.shape[1]
        rows = prompt_bucket(length) if self.buckets else length
        rows = min(max(rows, length), self.capacity)
        entry = self.prefills.get(rows)
        if entry is None:
            entry = self.prefills[rows] = _Prefill(self, rows)
        self.cache.reset()
        before = [t.clone() for t in _cache_state(self.cache)]
        entry.fill(ids, keep)
        entry.run(self.graphs, inductor)
        _rewind(self.cache, before, rows, length)
        return entry.next, entry.positions[:, length - 1] + 1


def _aligned(state: list[torch.Tensor], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values``, taken of the cache's counters before, for its counters ``state`` now: zeros where the cache's first
    forward created them (on the device) since."""
    return values if len(values) == len(state) else [torch.zeros_like(t) for t in state]


def _set(cache, values: list[torch.Tensor]) -> None:
    """The cache's counters (``_cache_state``) set to ``values``, a list taken of them before."""
    state = _cache_state(cache)
    for t, v in zip(state, _aligned(state, values)):
        t.copy_(v)


def _rewind(cache, before: list[torch.Tensor], ran: int, kept: int) -> None:
    """Counters a forward advanced by the padded prompt's ``ran`` tokens now count its ``kept`` ones (the padding's
    slots are overwritten by the decode steps)."""
    state = _cache_state(cache)
    if ran == kept:
        return
    for t, b in zip(state, _aligned(state, before)):
        if not t.dtype.is_floating_point and t.dtype != torch.bool:
            t.sub_(torch.where(t - b == ran, ran - kept, 0).to(t.dtype))


def session_for(model, batch: int, needed: int, device: torch.device, graphs: bool) -> DecodeSession:
    """The model's session for ``batch`` rows whose cache holds ``needed`` positions (a longer one replaces it)."""
    sessions = model.__dict__.setdefault("sparta_decode_sessions", {})
    s = sessions.get(batch)
    capacity = -(-needed // CAPACITY_STEP) * CAPACITY_STEP
    if s is None or s.capacity < needed or s.device != device or s.graphs != graphs:
        s = sessions[batch] = DecodeSession(model, batch, capacity, device, graphs)
    return s
