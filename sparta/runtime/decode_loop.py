"""Greedy decoding with one CUDA-graph replay per token and no host sync between tokens (gpt-fast's loop).

Hugging Face's loop pays the host ~1–2 ms a token (input preparation, logits processing, a stop check that waits for
the GPU), more than a sparse 7B decode step's kernels take. For the plain greedy call (no sampling, beams, processors,
streamers or stopping criteria of the user's) :func:`greedy_generate` runs the model's own forward in a loop of its
own: one CUDA graph runs a whole step — write the new key's slot into the 4-d mask, the forward (through
``torch.compile``: Inductor fuses the norms, rotary embedding and residual adds around sparta's kernel ops), the
argmax, the finished rows' padding, the next step's ids and positions — and the tokens are replays of it, checked
for end of sequence once per ``chunk`` tokens. The cache, the prefill graphs and the step graph stay on the model for
the next call (:mod:`sparta.runtime.decode_session`). A model the session cannot drive runs the recorded-step loop:
Hugging Face prefills and takes the first decode step, whose arguments (names, masks, cache) are recorded and
replayed. Without ``torch.compile`` the tokens equal Hugging Face's greedy loop's (the same kernels on the same
inputs); with it, up to near-ties (Inductor's fused norms round differently).
"""

from __future__ import annotations

import warnings

import torch

from .decode_graphs import _cache_state, full_mask, max_cache_length
from .decode_session import session_for, supports_session

#: generate() arguments the loop honours itself; any other argument runs Hugging Face's loop
SUPPORTED = {"attention_mask", "max_new_tokens", "do_sample", "pad_token_id", "eos_token_id", "num_beams",
             "cache_implementation", "use_cache"}


def supports(args: tuple, kwargs: dict) -> bool:
    """Whether a ``generate(*args, **kwargs)`` call is one :func:`greedy_generate` runs as Hugging Face would."""
    return (len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].is_cuda and args[0].dim() == 2
            and set(kwargs) <= SUPPORTED and not kwargs.get("do_sample", False)
            and kwargs.get("num_beams", 1) == 1 and kwargs.get("use_cache", True)
            and kwargs.get("cache_implementation", "static") == "static"
            and isinstance(kwargs.get("max_new_tokens"), int) and kwargs["max_new_tokens"] > 2)


class _Recorder:
    """Hugging Face's compiled-call hook for the first decode step: runs it eagerly and keeps its arguments."""

    def __init__(self, model):
        self.model, self.kwargs = model, None

    def __call__(self, **kwargs):
        if self.kwargs is None:
            self.kwargs = dict(kwargs)
        return self.model(**kwargs)


def _stop_after(new: int, prompt: int):
    from transformers import StoppingCriteria

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= prompt + new, dtype=torch.bool,
                              device=input_ids.device)
    return StopAfter()


def greedy_generate(model, ids: torch.Tensor, *, max_new_tokens: int, chunk: int = 32, graphs: bool = True,
                    inductor: bool | None = None, **kwargs) -> torch.Tensor:
    """``model.generate(ids, max_new_tokens=..., do_sample=False, ...)`` with a static cache, every token after the
    first one replay of one CUDA graph (``graphs=False`` or not on a GPU: the same steps called one by one).
    ``inductor`` (default: on a GPU): the step's forward goes through ``torch.compile`` first (Inductor fuses the
    norms, rotary embedding and residual adds around the kernels; compiled once per model and step shape), eager where
    that fails. A model a :class:`~sparta.runtime.decode_session.DecodeSession` serves keeps its cache, prefill
    graphs and step graph for the next call; any other runs the recorded-step loop."""
    graphs = graphs and ids.is_cuda
    inductor = ids.is_cuda if inductor is None else inductor
    eos, pad = _eos_and_pad(model, kwargs, ids.device)
    mask = kwargs.get("attention_mask")
    if supports_session(model, ids, mask):
        return _session_generate(model, ids, mask, max_new_tokens, eos, pad, chunk, graphs, inductor)
    return _recorded_generate(model, ids, max_new_tokens, eos, pad, chunk, graphs, inductor, kwargs)


def _eos_and_pad(model, kwargs: dict, device) -> tuple[torch.Tensor, int]:
    config = model.generation_config
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=device, dtype=torch.long)
    return eos, 0 if pad is None else int(pad)


def _session_generate(model, ids, mask, new: int, eos, pad: int, chunk: int, graphs: bool, inductor: bool):
    batch, length = ids.shape
    session = session_for(model, batch, length + new, ids.device, graphs)
    first, positions = session.prefill(ids, mask, inductor)
    first = first.clone()
    key = (tuple(eos.tolist()), pad, inductor)
    loop = session.loops.get(key)
    keep = torch.zeros(batch, session.capacity, dtype=torch.bool, device=ids.device)
    if loop is None:
        names = session.names
        static = {"input_ids": first[:, None].clone(), "position_ids": positions[:, None].clone()}
        if names["cache_position"]:
            static["cache_position"] = torch.tensor([length], device=ids.device)
        loop = session.loops[key] = StepLoop(model, static, {names["cache"]: session.cache, "use_cache": True},
                                             full_mask(model, keep, session.capacity), eos, pad, inductor)
    keep[:, :length] = True if mask is None else mask.bool()
    loop.arm(first[:, None], positions[:, None], length, full_mask(model, keep, session.capacity), length,
             torch.isin(first, eos) if eos.numel() else None)
    return _finish(ids, first[:, None], loop.run(new - 1, chunk, graphs), eos, loop)


def _finish(ids, head_new: torch.Tensor, tokens: torch.Tensor, eos, loop) -> torch.Tensor:
    """The prompt and the new tokens, cut where the last row ended (as Hugging Face stops)."""
    new = torch.cat([head_new, tokens], 1)
    if eos.numel() and bool(loop.done.all()):
        hit = torch.isin(new, eos)
        ended = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full_like(hit[:, 0], new.shape[1],
                                                                                   dtype=torch.long))
        new = new[:, : int(ended.max())]
    return torch.cat([ids, new], 1)


def _recorded_generate(model, ids, max_new_tokens: int, eos, pad: int, chunk: int, graphs: bool, inductor: bool,
                       kwargs: dict) -> torch.Tensor:
    """Hugging Face prefills and takes the first decode step, whose arguments are recorded; the rest are replays
    of that step's graph (models a session does not serve)."""
    from transformers import StoppingCriteriaList
    from transformers.generation import CompileConfig
    recorder = _Recorder(model)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("do_sample", "num_beams", "cache_implementation")}
    previous = model.__dict__.get("get_compiled_call")        # the hook generate() installs for HF's own loop
    model.get_compiled_call = lambda *_: recorder
    hook = {}
    if not ids.is_cuda:                 # Hugging Face calls the hook on accelerators only, unless told otherwise
        hook["compile_config"] = CompileConfig()
        hook["compile_config"]._compile_all_devices = True
    try:
        head = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, cache_implementation="static",
                              stopping_criteria=StoppingCriteriaList([_stop_after(2, ids.shape[1])]), **hook,
                              **kwargs)
    finally:
        if previous is None:
            del model.get_compiled_call
        else:
            model.get_compiled_call = previous
    step = recorder.kwargs
    if step is None or head.shape[1] != ids.shape[1] + 2:       # finished early (end of sequence) or not recorded
        return head
    mask = step.get("attention_mask")
    cache = step.get("past_key_values", step.get("cache"))
    length = max_cache_length(cache)
    if not (mask is None or isinstance(mask, torch.Tensor) and mask.dim() in (2, 4)) \
            or not isinstance(step.get("input_ids"), torch.Tensor) or length is None:   # per-layer masks, ...
        return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    batch, prompt = head.shape[0], head.shape[1] - 2
    if mask is None:                                    # no padding: the prompt and the first new key kept
        mask = torch.ones(batch, prompt + 1, dtype=torch.bool, device=head.device)
    mask = mask.clone() if mask.dim() == 4 else full_mask(model, mask, length)
    static = {k: v.clone() for k, v in step.items() if isinstance(v, torch.Tensor) and k != "attention_mask"}
    others = {k: v for k, v in step.items() if not isinstance(v, torch.Tensor)}
    loop = StepLoop(model, static, others, mask, eos, pad, inductor)
    done = torch.isin(head[:, prompt:], eos).any(1) if eos.numel() else None
    positions = static["position_ids"] + 1 if "position_ids" in static else None
    loop.arm(head[:, -1:], positions, prompt + 1, mask, prompt + 1, done)
    return _finish(ids, head[:, prompt:], loop.run(max_new_tokens - 2, chunk, graphs), eos, loop)


def compiled_step(model):
    """The model's forward through ``torch.compile`` (Inductor's default mode: the CUDA graph is the loop's), kept on
    the model: its decode steps compile once."""
    forward = getattr(model, "sparta_compiled_step", None)
    if forward is None:
        forward = torch.compile(model, dynamic=False)
        object.__setattr__(model, "sparta_compiled_step", forward)    # not a submodule: no second copy in state
    return forward


class StepLoop:
    """One decode step's static inputs and state (mask, next slot, tokens, finished rows) and, once captured, its
    CUDA graph: armed anew for each call, so a graph serves every call of its shapes."""

    def __init__(self, model, static: dict, others: dict, mask: torch.Tensor, eos: torch.Tensor, pad: int,
                 inductor: bool = False):
        self.model, self.eos, self.pad = model, eos, pad
        self.forward = compiled_step(model) if inductor else model
        self.warmed = not inductor
        self.inductor_error = None
        self.static, self.others, self.mask = static, others, mask
        self.cache = others.get("past_key_values", others.get("cache"))
        batch, dev = mask.shape[0], mask.device
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)          # where the next key goes in the cache
        self.index = torch.zeros(1, dtype=torch.long, device=dev)
        self.tokens = torch.full((batch, mask.shape[-1]), pad, dtype=torch.long, device=dev)
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.graph = None
        self.saved_state = []

    def arm(self, ids: torch.Tensor, positions: torch.Tensor | None, cache_position: int, mask: torch.Tensor,
            slot: int, done: torch.Tensor | None) -> None:
        """The next step's input ids and positions, the mask over the cache so far, the slot its key goes to."""
        self.static["input_ids"].copy_(ids)
        if positions is not None and "position_ids" in self.static:
            self.static["position_ids"].copy_(positions)
        if "cache_position" in self.static:
            self.static["cache_position"].fill_(cache_position)
        self.mask.copy_(mask)
        self.slot.fill_(slot)
        self.index.zero_()
        self.tokens.fill_(self.pad)
        if done is None:
            self.done.zero_()
        else:
            self.done.copy_(done)
        self.saved_state = [(t, t.clone()) for t in _cache_state(self.cache)]

    def _restore(self) -> None:
        """Undo what a forward of the next step did to the cache's counters (its keys and values are rewritten by
        the real step)."""
        for t, before in self.saved_state:
            t.copy_(before)

    def _advance_positions(self) -> None:
        for name in ("position_ids", "cache_position"):
            if name in self.static:
                self.static[name].add_(1)

    def step(self) -> None:
        self.mask.index_fill_(-1, self.slot, True if self.mask.dtype == torch.bool else 0.0)   # the new key: kept
        out = self.forward(**self.static, attention_mask=self.mask, **self.others)
        nxt = out.logits[:, -1].argmax(-1)
        nxt = torch.where(self.done, torch.full_like(nxt, self.pad), nxt)
        if self.eos.numel():
            self.done |= torch.isin(nxt, self.eos)
        self.tokens.index_copy_(1, self.index, nxt[:, None])
        self.static["input_ids"].copy_(nxt[:, None])
        self._advance_positions()
        self.slot.add_(1)
        self.index.add_(1)

    def run(self, steps: int, chunk: int, graphs: bool = True) -> torch.Tensor:
        """``steps`` tokens (fewer where every row ended), each one replay of the step's graph (captured on the
        first call: one step runs eagerly before it)."""
        with torch.no_grad():
            if not self.warmed:                               # compile on the step's inputs, before any state moves
                try:
                    self.forward(**self.static, attention_mask=self.mask.clone(), **self.others)
                except Exception as exc:  # noqa: BLE001 - Dynamo and Inductor fail in many ways: run the step eagerly
                    self.inductor_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                    warnings.warn(f"sparta generate: the decode step runs without torch.compile ({self.inductor_error})",
                                  stacklevel=3)
                    self.forward = self.model
                self._restore()
                self.warmed = True
            first = 0
            if graphs and self.graph is None and steps:
                self.step()                                   # eagerly: lazy allocations happen here
                first = 1
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):            # recorded, not run
                    self.step()
            replay = self.graph.replay if graphs else self.step
            done_at = steps
            for i in range(first, steps):
                replay()
                if (i + 1) % chunk == 0 and bool(self.done.all()):
                    done_at = i + 1
                    break
        return self.tokens[:, :done_at]
