"""Split-KV decode attention (flash-decoding) of one query token over a static KV cache, GQA, fp16/bf16 (``spec.py``)."""

from ..registry import KernelFamily, register

FAMILY = register(KernelFamily(
    "decode_attention", ("cuda",),
    "attention of one query token per sequence over a static KV cache with a kept-keys mask (GQA, fp16/bf16): split "
    "over chunks of keys, chunks with no kept key skipped, then combined",
    module=".runtime:DecodeAttentionCUDA",
    templates={".spec:DecodeAttentionSpec": ".kernel:decode_attention_kernel"},
    build=".build:build_decode_attention", epilogue=None), __name__)
