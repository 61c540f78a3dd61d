"""Greedy decoding with one CUDA-graph replay per token and no host sync between tokens (gpt-fast's loop).

Hugging Face's loop pays the host ~1–2 ms a token (input preparation, logits processing, a stop check that waits for
the GPU), more than a sparse 7B decode step's kernels take. For the plain greedy call (no sampling, beams, processors,
streamers or stopping criteria of the user's) :func:`greedy_generate` lets Hugging Face run the prefill and the first
decode step — so the cache, masks and input names are its own, whatever the transformers release — records the
arguments of that step, and captures one CUDA graph that runs a whole step: write the new key's slot into the 4-d
mask, the forward (through ``torch.compile``: Inductor fuses the norms, rotary embedding and residual adds around
sparta's kernel ops, which a decode step otherwise spends most of its launches on), the argmax, the finished rows'
padding, the next step's ids and positions. The remaining tokens are
replays of that graph, checked for end of sequence once per ``chunk`` tokens. Without ``torch.compile`` the tokens
equal Hugging Face's greedy loop's (the same kernels on the same inputs); with it, up to near-ties (Inductor's fused
norms round differently).
"""

from __future__ import annotations

import warnings

import torch

from .decode_graphs import _cache_state, full_mask, max_cache_length

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
    """``model.generate(ids, max_new_tokens=..., do_sample=False, ...)`` on a GPU with a static cache, every token
    after the second one replay of one CUDA graph (``graphs=False``: the same steps called one by one, any device).
    ``inductor`` (default: on a GPU): the step's forward goes through ``torch.compile`` first (Inductor fuses the
    norms, rotary embedding and residual adds around the kernels; compiled once per model and step shape), eager where
    that fails."""
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
    config = model.generation_config
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    step = recorder.kwargs
    if step is None or head.shape[1] != ids.shape[1] + 2:       # finished early (end of sequence) or not recorded
        return head
    mask = step.get("attention_mask")
    if not (mask is None or isinstance(mask, torch.Tensor) and mask.dim() in (2, 4)) \
            or not isinstance(step.get("input_ids"), torch.Tensor) or max_cache_length(
                step.get("past_key_values", step.get("cache"))) is None:   # per-layer masks (sliding windows), ...
        return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=ids.device, dtype=torch.long)
    pad = 0 if pad is None else int(pad)
    loop = _GraphLoop(model, step, head, eos, pad, max_new_tokens - 2, ids.is_cuda if inductor is None else inductor)
    return loop.run(chunk, graphs)


def compiled_step(model):
    """The model's forward through ``torch.compile`` (Inductor's default mode: the CUDA graph is the loop's), kept on
    the model: its decode steps compile once."""
    forward = getattr(model, "sparta_compiled_step", None)
    if forward is None:
        forward = torch.compile(model, dynamic=False)
        object.__setattr__(model, "sparta_compiled_step", forward)    # not a submodule: no second copy in state
    return forward


class _GraphLoop:
    """The static state of the loop and the graph of one step."""

    def __init__(self, model, step: dict, head: torch.Tensor, eos: torch.Tensor, pad: int, steps: int,
                 inductor: bool = False):
        self.model, self.steps, self.eos, self.pad = model, steps, eos, pad
        self.forward = compiled_step(model) if inductor else model
        self.inductor_error = None
        self.cache = step.get("past_key_values", step.get("cache"))
        length = max_cache_length(self.cache)
        batch, prompt = head.shape[0], head.shape[1] - 2
        self.static = {k: v.clone() for k, v in step.items() if isinstance(v, torch.Tensor) and k != "attention_mask"}
        self.others = {k: v for k, v in step.items() if not isinstance(v, torch.Tensor)}
        mask = step.get("attention_mask")
        if mask is None:                                    # no padding: the prompt and the first new key kept
            mask = torch.ones(batch, prompt + 1, dtype=torch.bool, device=head.device)
        # the step's own 4-d mask over the static cache, or the 2-d one's keys as such a mask
        self.mask = mask.clone() if mask.dim() == 4 else full_mask(model, mask, length)
        self.slot = torch.tensor([prompt + 1], device=head.device)     # where the next key goes in the cache
        self.index = torch.zeros(1, dtype=torch.long, device=head.device)
        self.tokens = torch.full((batch, steps), pad, dtype=torch.long, device=head.device)
        self.done = torch.isin(head[:, prompt:], eos).any(1) if eos.numel() else \
            torch.zeros(batch, dtype=torch.bool, device=head.device)
        self.head = head
        self.saved_state = [(t, t.clone()) for t in _cache_state(self.cache)]
        self.static["input_ids"].copy_(head[:, -1:])         # the second token is the next step's input
        self._advance_positions()

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

    def run(self, chunk: int, graphs: bool = True) -> torch.Tensor:
        with torch.no_grad():
            if self.forward is not self.model:                # compile on the step's inputs, before any state moves
                try:
                    self.forward(**self.static, attention_mask=self.mask.clone(), **self.others)
                except Exception as exc:  # noqa: BLE001 - Dynamo and Inductor fail in many ways: run the step eagerly
                    self.inductor_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                    warnings.warn(f"sparta generate: the decode step runs without torch.compile ({self.inductor_error})",
                                  stacklevel=3)
                    self.forward = self.model
                self._restore()
            self.step()                                       # the first step eagerly: lazy allocations happen here
            replay = self.step
            if graphs:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.step()
                replay = graph.replay
            done_at = self.steps
            for i in range(1, self.steps):
                replay()
                if (i + 1) % chunk == 0 and bool(self.done.all()):
                    done_at = i + 1
                    break
        tokens = self.tokens[:, :done_at]
        if self.eos.numel() and bool(self.done.all()):         # stop where the last row ended, as Hugging Face does
            ended = torch.isin(tokens, self.eos).float().argmax(1)
            ended = torch.where(torch.isin(tokens, self.eos).any(1), ended, torch.full_like(ended, tokens.shape[1]))
            already = torch.isin(self.head[:, -2:], self.eos).any(1)
            ended = torch.where(already, torch.zeros_like(ended), ended + 1)
            tokens = tokens[:, : int(ended.max())]
        return torch.cat([self.head, tokens], 1)
