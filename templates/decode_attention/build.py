"""Codegen of the decode-attention family: both kernels of one (Hq, Hkv, D, dtype) built and wrapped in their module.

No graph op stands for it (the captured graph is a decoder's cache-free forward): ``codegen/decode_kernels.py`` plans it
from the recorded model's config, so its build is :func:`build_decode_attention` by the attention's shape, not the
per-op ``build(graph, op, op_plan)`` of the families that run graph ops.
"""

from __future__ import annotations

from pathlib import Path

from ...codegen.cuda_build import build_cuda, save_dir
from .kernel import decode_attention_kernel
from .runtime import DecodeAttentionCUDA
from .spec import DecodeAttentionSpec


def decode_attention_specs(hq: int, hkv: int, d: int, dtype: str = "bfloat16", chunk: int = 64, threads: int = 128,
                           pdl: bool = True, name: str | None = None,
                           rope: bool = False) -> tuple[DecodeAttentionSpec, DecodeAttentionSpec]:
    """The (partial, combine) specs, named ``<name>_partial`` and ``<name>_combine`` (kernel folders of those names;
    ``rope``: the pair with the rotary embedding and cache write, ``<name>_rope_partial`` and ``_rope_combine``)."""
    name = name or f"decode_attention_{hq}x{hkv}x{d}_c{chunk}_t{threads}{'_bf16' if dtype == 'bfloat16' else ''}"
    name += "_rope" if rope else ""
    spec = DecodeAttentionSpec(hq, hkv, d, dtype, chunk=chunk, threads=threads, pdl=pdl, rope=rope)
    return tuple(DecodeAttentionSpec(**{**spec.key(), "stage": stage, "name": f"{name}_{stage}"})
                 for stage in ("partial", "combine"))


def build_decode_attention(hq: int, hkv: int, d: int, dtype: str = "bfloat16", chunk: int = 64, threads: int = 128,
                           pdl: bool = True, scale: float | None = None, name: str | None = None,
                           out: str | Path | None = None, rope: bool = False) -> DecodeAttentionCUDA:
    """Build both kernels (TVM + nvcc, cached) and return their module; ``rope``: the rope pair as well (the module's
    :meth:`~DecodeAttentionCUDA.rope_forward`); ``out``: also copy the kernel folders into ``out/<name>_partial``,
    ``out/<name>_combine`` (and ``_rope_*``; what :meth:`DecodeAttentionCUDA.from_folder` reads)."""
    pairs = []
    for with_rope in (False, True) if rope else (False,):
        folders = []
        for spec in decode_attention_specs(hq, hkv, d, dtype, chunk, threads, pdl, name, with_rope):
            art = build_cuda(decode_attention_kernel, spec)
            folders.append(save_dir(art, Path(out) / spec.name) if out is not None else art.path)
        pairs.append(tuple(folders))
    return DecodeAttentionCUDA(*pairs[0], scale=scale, rope_folders=pairs[1] if rope else None)


__all__ = ["build_decode_attention", "decode_attention_specs"]
