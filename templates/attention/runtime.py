"""Attention whose mask is computed from sizes alone: the mask dropped where it is all true, ``is_causal`` where it
is causal, decided once per shape.

Hugging Face's models reach ``scaled_dot_product_attention`` through torch.export with a boolean mask built from
``arange`` of the sequence length (all true for BERT without padding, causal for LLaMA): the exported graph must
keep it, since the graph serves every length. A masked call cannot skip the tiles a causal call skips, nor take the
mask-free kernels. Selection (``codegen/select_attention.py``) marks the attention ops whose mask depends on no
input's values, only on sizes; for them the mask is a function of the call's shapes (the graph's inputs are passed
along for theirs), so classifying it once per shape is exact. The first call of a shape reads the mask (one host
synchronisation, outside any CUDA-graph capture); later calls of that shape run the kernel its class allows. A call
met first while a CUDA graph is being captured runs masked and decides nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import SpartaError
from ...runtime.ops import KernelModule


def classify_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> str:
    """``"none"`` if ``mask`` masks nothing, ``"causal"`` if it is SDPA's ``is_causal`` mask (the lower triangle,
    upper-left aligned: key ``j`` kept for query ``i`` iff ``j <= i``) on every slice, else ``"mask"``. Boolean masks
    (true = attend) and additive float masks (0 = attend, -inf = masked)."""
    if mask.dim() < 2:
        return "mask"
    try:                                    # a mask broadcast over queries or keys is judged as sdpa reads it
        mask = mask.expand(*mask.shape[:-2], q_len, kv_len)
    except RuntimeError:
        return "mask"
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        keep, masked = mask, ~mask
    elif mask.is_floating_point():
        keep = mask == 0
        masked = mask == float("-inf")
        if not bool((keep | masked).all()):
            return "mask"                   # a finite bias: no mask sdpa can drop
    else:
        return "mask"
    if bool(keep.all()):
        return "none"
    if bool((keep == causal).all()) and bool((masked == ~causal).all()):
        return "causal"
    return "mask"


class SizesOnlyMaskAttention(KernelModule):
    """``scaled_dot_product_attention(q, k, v, attn_mask=mask, ...)`` for a mask that is a function of the shapes
    alone: per shape, the mask dropped, ``is_causal=True``, or the mask as given (:func:`classify_mask`). Outputs
    are laid out as (batch, sequence, heads, head dim) in memory, as the fused attention kernels write them, so the
    fake output's strides hold for every backend."""

    kernel_family = "attention"

    def __init__(self, op_name: str, input_names: list[str], scale: float | None = None, enable_gqa: bool = False):
        """``input_names``: query, key, value, mask, then the graph's inputs (read for their shapes only)."""
        super().__init__()
        if len(input_names) < 4:
            raise SpartaError(f"attention {op_name!r}: wants query, key, value and mask, got {input_names}")
        self.op_name, self.input_names = op_name, list(input_names)
        self.scale, self.enable_gqa = scale, bool(enable_gqa)
        self.classes: dict[tuple, str] = {}
        self.register_kernel(f"attention_{op_name}")

    def forward(self, q, k, v, mask, *graph_inputs):
        return self.call_kernel(q, k, v, mask, *graph_inputs)[0]

    def mask_class(self, q, k, v, mask, graph_inputs=()) -> str:
        key = (*(tuple(t.shape) for t in (q, k, v, mask, *graph_inputs)), mask.dtype, q.device)
        found = self.classes.get(key)
        if found is not None:
            return found
        if capturing(q):
            return "mask"                   # no host read inside a capture; this shape stays undecided
        found = self.classes[key] = classify_mask(mask, q.shape[-2], k.shape[-2])
        return found

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        q, k, v, mask, *graph_inputs = inputs
        kind = self.mask_class(q, k, v, mask, graph_inputs)
        extra = {"none": {}, "causal": {"is_causal": True}}.get(kind, {"attn_mask": mask})
        if self.enable_gqa:
            extra["enable_gqa"] = True
        return [in_layout(F.scaled_dot_product_attention(q, k, v, scale=self.scale, **extra))]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [output_like(inputs[0], inputs[2])]

    def saved_state(self):
        config = {"op_name": self.op_name, "input_names": self.input_names, "scale": self.scale,
                  "enable_gqa": self.enable_gqa}
        return config, {}, {}

    @classmethod
    def from_saved(cls, config: dict, tensors: dict, folders: dict) -> SizesOnlyMaskAttention:
        scale = config.get("scale")
        return cls(str(config["op_name"]), [str(n) for n in config["input_names"]],
                   None if scale is None else float(scale), bool(config.get("enable_gqa")))

    def extra_repr(self) -> str:
        decided = ", ".join(f"{key[0]}: {kind}" for key, kind in self.classes.items())
        return f"{self.op_name}: mask from sizes alone{'; ' + decided if decided else ''}"


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``t``'s device (its stream may not wait for the host)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def output_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An empty attention output for ``q`` and ``v``: (..., L, Ev), 4-D outputs laid out (B, L, H, E) in memory."""
    shape = (*q.shape[:-1], v.shape[-1])
    return torch.empty_strided(shape, output_strides(shape), dtype=q.dtype, device=q.device)


def output_strides(shape) -> tuple[int, ...]:
    """Strides of an attention output of ``shape``: (B, H, L, E) stored as (B, L, H, E); other ranks contiguous."""
    if len(shape) == 4:
        b, h, n, e = shape
        return (n * h * e, e, h * e, 1)
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def in_layout(out: torch.Tensor) -> torch.Tensor:
    """``out`` with :func:`output_strides`: itself where they match, restrided where they differ only in dimensions
    of size 1 (the same addresses), else copied."""
    want = output_strides(out.shape)
    if out.stride() == want:
        return out
    if all(a == b or n == 1 for a, b, n in zip(out.stride(), want, out.shape)):
        return out.as_strided(out.shape, want)
    return output_like(out, out).copy_(out)


__all__ = ["SizesOnlyMaskAttention", "classify_mask", "in_layout", "output_like", "output_strides"]
