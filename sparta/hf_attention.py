"""sparta's attention implementation for Hugging Face decoders (``config._attn_implementation = "sparta"``).

A one-token query over the cache with a boolean mask of kept keys (a decode step over a static cache) runs on the
decode-attention kernel the compile built (``codegen/decode_kernels.py``): split over chunks of the cache, chunks no
key reaches skipped, grouped-query heads read from the cache as they are. Everything else (prefill, masks of other
kinds, a CPU) is Hugging Face's SDPA attention, unchanged. Registered once per process under the name ``"sparta"``
with SDPA's mask function, so the model builds the masks SDPA takes.

Where the kernel module also holds the ``rope`` kernels and the attention module is one whose forward is Llama's
(projections, ``rotate_half`` rotary embedding of the whole head, a static cache layer, attention, output projection:
:data:`ROPE_ATTENTIONS`), a decode step's forward skips Hugging Face's rotary embedding and cache update too: the
kernels rotate the query and the new key, store the key and value into the cache layer at its write counter
(``cumulative_length``, which they advance as Hugging Face's ``StaticLayer.update`` does) and attend, three fewer
launches a layer. Every other call is the module's own forward.
"""

from __future__ import annotations

import types

import torch

NAME = "sparta"
KERNEL_ATTRIBUTE = "sparta_decode_attention"     # set on each attention module of a rebuilt decoder
#: model types -> attention classes whose forward is Llama's: q/k/v projections, full-head rotate_half rotary, cache
#: update, o_proj (the compile builds the rope kernels for these model types; attach takes them for these classes)
ROPE_ATTENTIONS = {"llama": "LlamaAttention", "qwen2": "Qwen2Attention", "mistral": "MistralAttention"}
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
        out = kernel(query[:, :, 0].contiguous(), key, value, _kept_slots(attention_mask))     # (B, Hq, D)
        return out.unsqueeze(1), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _decode_step(kernel, query, key, mask, dropout, scaling, kwargs) -> bool:
    """Whether this call is one the kernel computes exactly: one query per row over ``key``'s positions, a boolean
    (B, 1, 1, S) mask, the kernel's shape, dtype and softmax scale, no dropout, softcap or sliding window."""
    s = kernel.spec
    return (query.is_cuda and query.dim() == 4 and query.shape[2] == 1 and _cache_mask(mask, key.shape[2])
            and tuple(query.shape[1:2]) == (s.hq,) and key.shape[1] == s.hkv
            and query.shape[-1] == s.d and query.dtype == key.dtype == kernel.dtype and not dropout
            and (scaling is None or _same_scale(kernel, scaling))
            and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
            and kwargs.get("position_bias") is None and key.is_contiguous()
            and kwargs.get("s_aux") is None)


def attach(model, kernel) -> list[tuple[str, bool]]:
    """Put ``kernel`` (a ``DecodeAttentionCUDA``) on every attention module of ``model`` whose heads it fits and switch
    the model to ``"sparta"`` attention; returns ``(path, rope)`` per module, ``rope`` where its decode steps also run
    the rotary embedding and cache write on the kernels (none: the model is left as it was)."""
    register()
    spec, paths = kernel.spec, []
    for path, m in model.named_modules():
        if not hasattr(m, "layer_idx") or not any(hasattr(m, p) for p in ("q_proj", "c_attn", "qkv_proj")):
            continue
        heads = getattr(getattr(m, "config", None), "num_attention_heads", None)
        if heads == spec.hq and getattr(m, "head_dim", spec.d) == spec.d:
            m.__dict__[KERNEL_ATTRIBUTE] = kernel           # not a submodule: the model's state dict stays its own
            rope = bool(getattr(kernel, "has_rope", False)) and type(m).__name__ in ROPE_ATTENTIONS.values() \
                and all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) \
                and not any(hasattr(m, p) for p in ("q_norm", "k_norm")) and getattr(m, "sliding_window", None) is None
            if rope:
                m.forward = types.MethodType(_rope_forward, m)
            paths.append((path, rope))
    if paths:
        model.config._attn_implementation = NAME
    return paths


def _rope_forward(module, hidden_states, *args, **kwargs):
    """A Llama-style attention module's forward: a decode step over a static cache layer on the rope kernels (rotary
    embedding, cache write and attention in one pair of launches), any other call the module's own forward."""
    names = ("position_embeddings", "attention_mask")
    given = dict(zip(names, args[:2]), **{n: kwargs[n] for n in names if n in kwargs})
    cache = kwargs.get("past_key_values", kwargs.get("cache", args[2] if len(args) > 2 else None))
    kernel = module.__dict__.get(KERNEL_ATTRIBUTE)
    layer = _static_layer(cache, module.layer_idx)
    if layer is None or not _rope_step(kernel, module, hidden_states, given.get("position_embeddings"),
                                       given.get("attention_mask"), layer, kwargs):
        return type(module).forward(module, hidden_states, *args, **kwargs)
    s, b = kernel.spec, hidden_states.shape[0]
    qkv = _stacked_projections(module, hidden_states, s)
    cos, sin = (t.reshape(b, s.d).contiguous() for t in given["position_embeddings"])
    out = kernel.rope_forward(qkv, cos, sin, _kept_slots(given["attention_mask"]), layer.keys, layer.values,
                              layer.cumulative_length)
    return module.o_proj(out.reshape(b, 1, s.hq * s.d)), None


def _stacked_projections(module, x, spec) -> torch.Tensor:
    """The step's query, key and value projections as one (B, Hq + 2 Hkv, D) tensor: the output of the stacked kernel
    where q/k/v_proj are its three slices in that order (no copy), else the three outputs concatenated."""
    b, widths = x.shape[0], (spec.hq * spec.d, spec.hkv * spec.d, spec.hkv * spec.d)
    parts = [getattr(module, p) for p in ("q_proj", "k_proj", "v_proj")]
    shared = getattr(parts[0], "shared", None)
    if all(type(p).__name__ == "KernelSlice" and p.shared is shared for p in parts) \
            and [(p.start, p.end) for p in parts] == [(0, widths[0]), (widths[0], widths[0] + widths[1]),
                                                       (widths[0] + widths[1], sum(widths))]:
        out = shared.kernel(x)
        if out.shape[-1] == sum(widths):
            return out.reshape(b, -1, spec.d).contiguous()
    return torch.cat([p(x) for p in parts], -1).reshape(b, -1, spec.d).contiguous()


def _static_layer(cache, index: int):
    """Layer ``index`` of a Hugging Face static cache, where it is one (initialised, not offloaded), else None."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)) or index >= len(layers) or getattr(cache, "offloading", False):
        return None
    layer = layers[index]
    if type(layer).__name__ != "StaticLayer" or not getattr(layer, "is_initialized", False):
        return None
    return layer


def _rope_step(kernel, module, x, position_embeddings, mask, layer, kwargs) -> bool:
    """Whether this call is a decode step the rope kernels compute as the module would: one new token per row, the
    kernel's dtype and heads, the model's rotary tables of the whole head, a boolean (B, 1, 1, S) mask over the static
    layer's S slots, its write counter a device int64, no dropout or attention extras."""
    s = kernel.spec
    keys, counter = getattr(layer, "keys", None), getattr(layer, "cumulative_length", None)
    if not (isinstance(x, torch.Tensor) and x.device.type == getattr(kernel, "device_type", "cuda")
            and x.dim() == 3 and x.shape[1] == 1
            and x.dtype == kernel.dtype and not module.training and isinstance(keys, torch.Tensor)
            and isinstance(counter, torch.Tensor) and counter.numel() == 1 and counter.dtype == torch.int64
            and counter.device == x.device and keys.device == x.device):
        return False
    b = x.shape[0]
    tables = position_embeddings if isinstance(position_embeddings, (tuple, list)) else ()
    return (len(tables) == 2 and all(isinstance(t, torch.Tensor) and tuple(t.shape) == (b, 1, s.d)
                                     and t.dtype == kernel.dtype for t in tables)
            and tuple(keys.shape) == (b, s.hkv, keys.shape[2], s.d) and keys.dtype == kernel.dtype
            and keys.is_contiguous() and layer.values.shape == keys.shape and layer.values.is_contiguous()
            and _cache_mask(mask, keys.shape[2]) and mask.shape[0] == b
            and _same_scale(kernel, getattr(module, "scaling", s.d ** -0.5))
            and not kwargs.get("output_attentions") and kwargs.get("sliding_window") is None)


def _cache_mask(mask, slots: int) -> bool:
    """Whether ``mask`` is the boolean (B, 1, 1, slots) mask of one query per row over a static cache's slots."""
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape[1] == mask.shape[2] == 1 and mask.shape[-1] == slots)


def _kept_slots(mask: torch.Tensor) -> torch.Tensor:
    """The (B, S) bool rows of a :func:`_cache_mask` mask, contiguous as the kernels read them (Hugging Face may build
    the mask expanded over the batch)."""
    return mask[:, 0, -1].contiguous()


def _same_scale(kernel, scaling) -> bool:
    """Whether the call's softmax scale is the kernel's (to fp32 rounding)."""
    return abs(float(scaling) - kernel.scale_value) <= 1e-6 * kernel.scale_value
