"""The third stage: how a compiled model's calls run through torch.compile (``CompiledModel.inductor``).

``"cudagraph"`` (the default on CUDA) compiles the fx module in Inductor's default mode and replays one CUDA graph
per input shape (:class:`CudaGraphRunner`). ``torch.compile(mode="reduce-overhead")`` records CUDA graphs too, but
checks every parameter's address and runs Dynamo's guards on each call (~280 µs of host time on a 4-layer
LLaMA-style decoder, more than its GPU time at one token); here a call copies its inputs into the graph's static
inputs and replays: ~30 µs of host time.
"""

from __future__ import annotations

import torch

from ..errors import SpartaError

INDUCTOR_MODES = ("cudagraph", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def inductor_mode(inductor, target: str) -> str | None:
    """The way a model of ``target`` runs for the ``inductor`` option: None (the default) is ``"cudagraph"`` on
    CUDA and no torch.compile on the CPU; False none; True Inductor's default mode; else one of :data:`INDUCTOR_MODES`."""
    if inductor is None:
        return "cudagraph" if target == "cuda" else None
    if inductor is False:
        return None
    if inductor is True:
        return "default"
    if inductor not in INDUCTOR_MODES:
        raise SpartaError(f"inductor must be None, False, True or a torch.compile mode {INDUCTOR_MODES}, "
                          f"got {inductor!r}")
    return inductor


def compiled_runner(module: torch.nn.Module, mode: str):
    """``module`` through torch.compile in ``mode`` (whole graph: sparta's kernels are ops, nothing breaks it)."""
    if mode == "cudagraph":
        return CudaGraphRunner(torch.compile(module, mode="default", fullgraph=True))
    return torch.compile(module, mode=mode, fullgraph=True)


class CudaGraphRunner:
    """``runner(*inputs)``: ``fn(*inputs)`` replayed from a CUDA graph captured on the first call of each input
    signature (shapes, dtypes, device). The outputs are the graph's static tensors: the next call of that signature
    overwrites them."""

    def __init__(self, fn, warmup: int = 2):
        self.fn, self.warmup = fn, warmup
        self.graphs: dict[tuple, tuple] = {}

    def __call__(self, *inputs: torch.Tensor):
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(inputs)
        graph, static, outputs = entry
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        return outputs

    def _capture(self, inputs) -> tuple:
        static = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):      # compile, load kernels and allocate outside the capture
            for _ in range(self.warmup):
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(*static)
        return graph, static, outputs


__all__ = ["CudaGraphRunner", "INDUCTOR_MODES", "compiled_runner", "inductor_mode"]
