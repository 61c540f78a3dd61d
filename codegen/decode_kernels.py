"""Kernels only ``generate()``'s decode steps run: for a Hugging Face decoder compiled for CUDA, attention of one new
token over the static cache on the ``decode_attention`` family (split-KV, empty chunks of the cache skipped), chosen
from the model's recorded config (heads, key/value heads, head size) and its 16-bit dtype.

The captured graph is the cache-free forward, so no graph op stands for this attention: the choice is the plan's
``decode`` entry and the module is kept on the compiled model (``CompiledModel.decode_modules``), saved with it.
"""

from __future__ import annotations

import os

import torch

from ..graph import Graph
from ..passes.transform.plan import KernelChoice

HEAD_SIZES = (64, 128, 256)          # what the decode_attention kernels are built for
DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def attention_shape(graph: Graph) -> tuple[dict | None, str]:
    """``(dict(hq, hkv, d, dtype), why)`` of the recorded decoder's attention, or ``(None, why not)``."""
    record = graph.hf_model
    if not record or not record.get("generative"):
        return None, "not a Hugging Face causal LM"
    from ..frontend.hf import model_config
    config = model_config(record)
    hq = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not hq or not hidden:
        return None, "its config names no attention heads"
    hkv = getattr(config, "num_key_value_heads", None) or hq
    d = getattr(config, "head_dim", None) or hidden // hq
    dtype = _model_dtype(graph)
    if d not in HEAD_SIZES:
        return None, f"head size {d} (decode attention kernels take {HEAD_SIZES})"
    if dtype is None:
        return None, "its weights are not fp16 or bf16"
    if hq % hkv:
        return None, f"{hq} heads over {hkv} key/value heads"
    return dict(hq=int(hq), hkv=int(hkv), d=int(d), dtype=dtype, rope=_llama_rope(config)), ""


def _llama_rope(config) -> bool:
    """Whether the decoder's attention rotates whole heads the Llama way, so its decode steps can run the rope kernels
    (rotary embedding and cache write fused)."""
    from ..hf_attention import ROPE_ATTENTIONS
    factor = getattr(config, "partial_rotary_factor", None)
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", factor) if isinstance(rope, dict) else factor
    return getattr(config, "model_type", "") in ROPE_ATTENTIONS and factor in (None, 1, 1.0) \
        and not getattr(config, "use_sliding_window", False)


def _model_dtype(graph: Graph) -> str | None:
    """The 16-bit dtype of the decoder's weights (the most elements), or None."""
    sizes: dict = {}
    for t in graph.tensors("weight"):
        if t.dtype in DTYPES:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + int(torch.Size(t.shape).numel())
    return DTYPES[max(sizes, key=sizes.get)] if sizes else None


def enabled() -> bool:
    """On unless ``SPARTA_DECODE_ATTENTION=0`` (decode steps then keep torch's SDPA)."""
    return os.environ.get("SPARTA_DECODE_ATTENTION", "1") != "0"


def decode_attention(graph: Graph, chunk: int = 64, threads: int = 128):
    """``(KernelChoice, module)`` of the decode steps' attention, or ``(None, None)`` where no kernel fits or
    :func:`enabled` is off."""
    shape, _ = attention_shape(graph)
    if shape is None or not enabled():
        return None, None
    from ..templates.decode_attention.build import build_decode_attention
    module = build_decode_attention(shape["hq"], shape["hkv"], shape["d"], shape["dtype"], chunk=chunk,
                                    threads=threads, rope=shape["rope"])
    choice = KernelChoice("decode_attention", "hf_decoder",
                          "one new token over the static cache: split-KV, chunks of the cache no key reaches skipped"
                          + ("; the rotary embedding and cache write in the same launches" if shape["rope"] else ""),
                          dtype=shape["dtype"], tiles=dict(shape, chunk=chunk, threads=threads))
    return choice, module
