"""Decode attention over a static KV cache: sparta's split-KV kernels against torch's SDPA, in one process.

    python benchmarks/bench_cuda_decode_attention.py --build [DIR]            # here (TVM + nvcc); DIR: artifacts/cuda_da/
    python benchmarks/bench_cuda_decode_attention.py [--dir DIR] [--out FILE] # on the GPU machine (torch + cuda-bindings)

One query token per sequence, bf16, (Hq, Hkv, D) of (32, 32, 128) and (32, 8, 128), batches of 1 and 16, caches of
640 keys all kept, 640 with the first 300 kept, 4096 all kept and 4096 with the first 300 kept (a static cache of
capacity 4096 filled to 300). Peers: ``sdpa_mask`` (torch's SDPA on q (B, Hq, 1, D) with the (B, 1, 1, S) bool mask,
what a Hugging Face model runs today), ``sdpa_kept`` (SDPA without a mask over the kept keys only: a floor-ish peer)
and ``floor`` (the kept K and V bytes at the measured copy bandwidth). ``sparta`` is the default build (chunks of 64
keys, 128 threads), ``sparta_c32`` chunks of 32. Each is checked against ``decode_attention_ref`` first, then timed
kernel-only: CUDA graphs of 40 calls rotating input sets beyond the L2.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from common import build_or_time, gpu_kernel_us, save  # noqa: E402  (benchmarks/ is the script's folder)

OUT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda")
           ).parent / "cuda_da"
HEADS = ((32, 32, 128), (32, 8, 128))
VARIANTS = {"sparta": dict(chunk=64, threads=128), "sparta_c32": dict(chunk=32, threads=128)}
CASES = ((640, 640), (640, 300), (4096, 4096), (4096, 300))     # (cache keys S, kept prefix)
BATCHES = (1, 16)
L2_BEATING_BYTES = 256 << 20


def name(heads, variant) -> str:
    hq, hkv, d = heads
    return f"da_{hq}x{hkv}x{d}_{variant}"


def build(folder: Path, jobs: int) -> None:
    from sparta.codegen.cuda_build import build_folders
    from sparta.templates.decode_attention.build import decode_attention_specs
    specs = {}
    for heads in HEADS:
        for variant, kw in VARIANTS.items():
            for spec in decode_attention_specs(*heads, "bfloat16", name=name(heads, variant), **kw):
                specs[spec.name] = spec
    build_folders(specs, folder, jobs, log=lambda line: print(line, flush=True))


def copy_bandwidth() -> float:
    """GB/s of a 256 MiB device-to-device copy, bytes read plus written."""
    a = torch.empty(128 << 20, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / gpu_kernel_us(lambda i: b.copy_(a), 1, per_graph=10) / 1e3


def bench(heads, b: int, s: int, kept: int, root: Path, bw: float) -> dict:
    from sparta.templates.decode_attention.runtime import DecodeAttentionCUDA
    from sparta.templates.decode_attention.spec import decode_attention_ref
    hq, hkv, d = heads
    scale = d ** -0.5
    kv_bytes = 2 * b * hkv * s * d * 2
    sets = max(2, min(16, math.ceil(L2_BEATING_BYTES / kv_bytes)))
    g = torch.Generator(device="cuda").manual_seed(b * 7919 + s + kept)
    qs = [torch.randn(b, hq, d, device="cuda", generator=g).bfloat16() for _ in range(sets)]
    ks = [torch.randn(b, hkv, s, d, device="cuda", generator=g).bfloat16() for _ in range(sets)]
    vs = [torch.randn(b, hkv, s, d, device="cuda", generator=g).bfloat16() for _ in range(sets)]
    keep = (torch.arange(s, device="cuda") < kept)[None, :].expand(b, s).contiguous()
    mask = keep[:, None, None, :]
    gqa = dict(enable_gqa=True) if hq != hkv else {}
    mods = {v: DecodeAttentionCUDA.from_folder(root, name(heads, v), scale).cuda() for v in VARIANTS}
    want = decode_attention_ref(qs[0], ks[0], vs[0], keep, scale).float()
    err = {v: (m(qs[0], ks[0], vs[0], keep).float() - want).abs().max().item() for v, m in mods.items()}
    sdpa = F.scaled_dot_product_attention(qs[0][:, :, None], ks[0], vs[0], attn_mask=mask, scale=scale, **gqa)
    err["sdpa_mask"] = (sdpa[:, :, 0].float() - want).abs().max().item()
    for v, e in err.items():
        if not e < 0.05:
            raise SystemExit(f"{v} is wrong at B={b} S={s} kept={kept} {heads}: max |err| {e}")
    fns = {v: (lambda i, m=m: m(qs[i], ks[i], vs[i], keep)) for v, m in mods.items()}
    fns["sdpa_mask"] = lambda i: F.scaled_dot_product_attention(qs[i][:, :, None], ks[i], vs[i], attn_mask=mask,
                                                                scale=scale, **gqa)
    fns["sdpa_kept"] = lambda i: F.scaled_dot_product_attention(qs[i][:, :, None], ks[i][:, :, :kept],
                                                                vs[i][:, :, :kept], scale=scale, **gqa)
    us = {k: gpu_kernel_us(fn, sets) for k, fn in fns.items()}
    read = 2 * b * hkv * kept * d * 2                                   # the kept K and V bytes
    us["floor"] = read / bw / 1e3
    return {"hq": hq, "hkv": hkv, "d": d, "batch": b, "keys": s, "kept": kept, "input_sets": sets,
            "kept_kv_MB": read / 1e6, "us": {k: round(t, 2) for k, t in us.items()}, "max_abs_err": err,
            "sparta_GBps": read / us["sparta"] / 1e3, "sparta_of_floor": us["floor"] / us["sparta"],
            "sdpa_mask_over_sparta": us["sdpa_mask"] / us["sparta"],
            "sdpa_kept_over_sparta": us["sdpa_kept"] / us["sparta"]}


def main():
    args = build_or_time(__doc__, OUT, build)
    if args is None:
        return
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    rows = []
    for heads in HEADS:
        for b in BATCHES:
            for s, kept in CASES:
                rows.append(bench(heads, b, s, kept, Path(args.dir), bw))
                r = rows[-1]
                print(f"{r['hq']}x{r['hkv']}x{r['d']} B={b:2d} S={s:4d} kept={kept:4d}: " +
                      " ".join(f"{k} {t:.2f}" for k, t in r["us"].items()) +
                      f" µs; sparta {r['sparta_GBps']:.0f} GB/s, {r['sdpa_mask_over_sparta']:.2f}x sdpa_mask",
                      flush=True)
    payload = {"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": rows}
    print(f"wrote {save('decode_attention', payload)}")
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
