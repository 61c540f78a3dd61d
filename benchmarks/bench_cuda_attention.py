"""Attention as the exported graphs call it, against the mask-free call: what a data-independent mask costs.

    python benchmarks/bench_cuda_attention.py

Hugging Face's models reach ``scaled_dot_product_attention`` with a boolean mask built from the sequence length alone:
all true for BERT without padding, causal for LLaMA. Kernel-only µs (CUDA graph replays, inputs rotated) of the call
with that mask (broadcast over heads, as the graph passes it) against ``attn_mask=None`` (BERT) or ``is_causal=True``
(LLaMA), under torch's own backend choice and each backend forced, and sparta's attention op (the mask's class
decided on the first call of the shape, the output in the layout its fake promises); each checked against the masked
call, q, k and v laid out as the graphs pass them (heads split from one projection, transposed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_kernel_us, save  # noqa: E402

CASES = (  # name, batch, heads, sequence, head dim, dtype, causal
    ("llama_prefill_1x512", 1, 16, 512, 128, torch.bfloat16, True),
    ("llama_1x128", 1, 16, 128, 128, torch.bfloat16, True),
    ("bert_32x128", 32, 12, 128, 64, torch.float16, False),
    ("bert_8x512", 8, 12, 512, 64, torch.float16, False),
    ("bert_1x128", 1, 12, 128, 64, torch.float16, False),
)
BACKENDS = {"auto": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def graph_mask(batch: int, seq: int, causal: bool) -> torch.Tensor:
    i = torch.arange(seq, device="cuda")
    mask = (i[None, :] <= i[:, None]) if causal else torch.ones(seq, seq, dtype=torch.bool, device="cuda")
    return mask[None, None].expand(batch, -1, seq, seq)


def main():
    from sparta.templates.attention.runtime import SizesOnlyMaskAttention
    rows = {}
    for name, b, h, s, d, dtype, causal in CASES:
        # q, k, v as the graphs pass them: heads split from a (B, L, H·E) projection, transposed
        qkv = [[torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3)]
               for _ in range(4)]
        mask = graph_mask(b, s, causal)
        sparta_attention = SizesOnlyMaskAttention(name, ["q", "k", "v", "mask"])
        calls = {"masked": lambda i: F.scaled_dot_product_attention(*qkv[i], attn_mask=mask),
                 "specialised": lambda i: F.scaled_dot_product_attention(*qkv[i], is_causal=causal)}
        want = calls["masked"](0).float()
        row = {}
        for backend, which in BACKENDS.items():
            for kind, fn in calls.items():
                try:
                    if which is None:
                        got = fn(0)
                        us = gpu_kernel_us(fn, 4)
                    else:
                        with sdpa_kernel([which]):
                            got = fn(0)
                            us = gpu_kernel_us(fn, 4)
                except RuntimeError as exc:            # the backend refuses this call
                    row[f"{backend}/{kind}"] = str(exc).splitlines()[0][:80]
                    continue
                err = float((got.float() - want).abs().max() / want.abs().max())
                row[f"{backend}/{kind}"] = {"us": round(us, 2), "rel_err": err, "strides": list(got.stride())}
        got = sparta_attention(*qkv[0], mask)           # the first call of the shape decides its mask's class
        row["sparta"] = {"us": round(gpu_kernel_us(lambda i: sparta_attention(*qkv[i], mask), 4), 2),
                         "class": next(iter(sparta_attention.classes.values())),
                         "rel_err": float((got.float() - want).abs().max() / want.abs().max())}
        rows[name] = row
        print(name, {k: (v["us"] if isinstance(v, dict) else "n/a") for k, v in row.items()}, flush=True)
    print(save("cuda_attention", {"cases": rows}))


if __name__ == "__main__":
    main()
