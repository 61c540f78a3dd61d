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
                           pdl: bool = True, name: str | None = None) -> tuple[DecodeAttentionSpec, DecodeAttentionSpec]:
    """The (partial, combine) specs, named ``<name>_partial`` and ``<name>_combine`` (kernel folders of those names)."""
    name = name or f"decode_attention_{hq}x{hkv}x{d}_c{chunk}_t{threads}{'_bf16' if dtype == 'bfloat16' else ''}"
    spec = DecodeAttentionSpec(hq, hkv, d, dtype, chunk=chunk, threads=threads, pdl=pdl)
    return tuple(DecodeAttentionSpec(**{**spec.key(), "stage": stage, "name": f"{name}_{stage}"})
                 for stage in ("partial", "combine"))


def build_decode_attention(hq: int, hkv: int, d: int, dtype: str = "bfloat16", chunk: int = 64, threads: int = 128,
                           pdl: bool = True, scale: float | None = None, name: str | None = None,
                           out: str | Path | None = None) -> DecodeAttentionCUDA:
    """Build both kernels (TVM + nvcc, cached) and return their module; ``out``: also copy the two kernel folders
    into ``out/<name>_partial`` and ``out/<name>_combine`` (what :meth:`DecodeAttentionCUDA.from_folder` reads)."""
    folders = []
    for spec in decode_attention_specs(hq, hkv, d, dtype, chunk, threads, pdl, name):
        art = build_cuda(decode_attention_kernel, spec)
        folders.append(save_dir(art, Path(out) / spec.name) if out is not None else art.path)
    return DecodeAttentionCUDA(*folders, scale=scale)


__all__ = ["build_decode_attention", "decode_attention_specs"]
