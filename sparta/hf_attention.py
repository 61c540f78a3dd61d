"""sparta's attention implementation for Hugging Face decoders (``config._attn_implementation = "sparta"``).

A one-token query over the cache with a boolean mask of kept keys (a decode step over a static cache) runs on the
decode-attention kernel the compile built (``codegen/decode_kernels.py``): split over chunks of the cache, chunks no
key reaches skipped, grouped-query heads read from the cache as they are. Everything else (prefill, masks of other
kinds, a CPU) is Hugging Face's SDPA attention, unchanged. Registered once per process under the name ``"sparta"``
with SDPA's mask function, so the model builds the masks SDPA takes.
"""

from __future__ import annotations

import torch

NAME = "sparta"
KERNEL_ATTRIBUTE = "sparta_decode_attention"     # set on each attention module of a rebuilt decoder
_registered = False


def register() -> None:
    """Make ``"sparta"`` an attention implementation transformers knows (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Hugging Face's attention-function signature: ``(attn_output (B, L, Hq, D), None)``."""
    kernel = module.__dict__.get(KERNEL_ATTRIBUTE)
    if kernel is not None and _decode_step(kernel, query, key, attention_mask, dropout, scaling, kwargs):
        keep = attention_mask[:, 0, -1]                                     # (B, S) bool
        out = kernel(query[:, :, 0].contiguous(), key, value, keep)        # (B, Hq, D)
        return out.unsqueeze(1), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _decode_step(kernel, query, key, mask, dropout, scaling, kwargs) -> bool:
    """Whether this call is one the kernel computes exactly: one query per row over ``key``'s positions, a boolean
    (B, 1, 1, S) mask, the kernel's shape, dtype and softmax scale, no dropout, softcap or sliding window."""
    s = kernel.spec
    return (query.is_cuda and query.dim() == 4 and query.shape[2] == 1 and mask is not None
            and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1
            and mask.shape[-1] == key.shape[2] and tuple(query.shape[1:2]) == (s.hq,) and key.shape[1] == s.hkv
            and query.shape[-1] == s.d and query.dtype == key.dtype == kernel.dtype and not dropout
            and (scaling is None or abs(float(scaling) - kernel.scale_value) <= 1e-6 * kernel.scale_value)
            and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
            and kwargs.get("position_bias") is None and key.is_contiguous()
            and kwargs.get("s_aux") is None)


def attach(model, kernel) -> list[str]:
    """Put ``kernel`` (a ``DecodeAttentionCUDA``) on every attention module of ``model`` whose heads it fits and switch
    the model to ``"sparta"`` attention; returns the modules' paths (none: the model is left as it was)."""
    register()
    spec, paths = kernel.spec, []
    for path, m in model.named_modules():
        if not hasattr(m, "layer_idx") or not any(hasattr(m, p) for p in ("q_proj", "c_attn", "qkv_proj")):
            continue
        heads = getattr(getattr(m, "config", None), "num_attention_heads", None)
        if heads == spec.hq and getattr(m, "head_dim", spec.d) == spec.d:
            m.__dict__[KERNEL_ATTRIBUTE] = kernel           # not a submodule: the model's state dict stays its own
            paths.append(path)
    if paths:
        model.config._attn_implementation = NAME
    return paths
