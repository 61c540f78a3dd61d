"""Compile time and memory at LLM scale: a Llama-2-7B-shaped ``LlamaForCausalLM`` (bf16, random weights) with every
decoder linear block-sparse, compiled by ``sparta.compile``; the time of each pass and the peak RSS.

    python benchmarks/bench_compile_scale.py --layers 1 --target cuda        # a fresh (cold) kernel cache
    python benchmarks/bench_compile_scale.py --layers 32 --target cuda --cache-dir /tmp/k --out results.json
    python benchmarks/bench_compile_scale.py --layers 32 --target cuda --cache-dir /tmp/k  # again: warm
    python benchmarks/bench_compile_scale.py --layers 4 --density 1 --bits 4 --save /tmp/w4   # every linear 4-bit

Each linear (q/k/v/o/gate/up/down proj) keeps ``--density`` of its ``--block``-square blocks, drawn at random from a
fixed seed (one mask per linear). ``--cache-dir``: the kernel cache (``SPARTA_CACHE``); without it a fresh temporary
folder (a cold compile). Prints one JSON object: the per-pass times (``compiled.timings``), the wall time of the
compile, of building the model, and the peak RSS of the process (``resource.getrusage``, which includes the model).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def llama_7b(layers: int, vocab: int, meta: bool):
    """Llama-2-7B's shape with ``layers`` decoder layers, bf16, random weights (built in bf16: no fp32 copy)."""
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=vocab, use_cache=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta") if meta else torch.device("cpu"):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval(), cfg


def block_masks(model, block: int, density: float, seed: int = 0, bits: int = 16) -> dict:
    """``{weight name: TeSA}``: each decoder linear keeps ``density`` of its blocks, at random (seeded), at ``bits``
    (a density of 1: every element, a uniform TeSA)."""
    import sparta
    g = torch.Generator().manual_seed(seed)
    out = {}
    params = dict(model.named_parameters())
    for i in range(model.config.num_hidden_layers):
        for part in LINEARS:
            name = f"model.layers.{i}.{part}.weight"
            n, k = params[name].shape
            if density >= 1:
                out[name] = sparta.TeSA.dense((n, k), bits=bits)
                continue
            blocks = torch.rand(n // block, k // block, generator=g) < density
            out[name] = sparta.TeSA.from_blocks(blocks, (block, block), bits=bits)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--target", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--density", type=float, default=0.1, help="kept fraction of each linear's blocks")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--bits", type=int, default=16, help="the linears' weight bits (4: W4A16 on CUDA)")
    ap.add_argument("--save", help="also save the compiled model here (kernels only) and time it")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--meta", action="store_true", help="the model's parameters on the meta device (masks only)")
    ap.add_argument("--cache-dir", help="the kernel cache (SPARTA_CACHE); default: a fresh folder (cold)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    cache = args.cache_dir or tempfile.mkdtemp(prefix="sparta-cold-")
    os.environ["SPARTA_CACHE"] = cache
    cold = not Path(cache).is_dir() or not any(Path(cache).iterdir())
    import sparta
    t0 = time.perf_counter()
    model, cfg = llama_7b(args.layers, args.vocab, args.meta)
    tesa = block_masks(model, args.block, args.density, bits=args.bits)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    model_s, model_rss = time.perf_counter() - t0, peak_rss_gib()
    print(f"model: {args.layers} layers, built in {model_s:.1f} s, peak RSS {model_rss:.2f} GiB", file=sys.stderr)
    t0 = time.perf_counter()
    compiled = sparta.compile(model, tesa, (ids,), target=args.target)
    wall = time.perf_counter() - t0
    compile_rss = peak_rss_gib()
    save_s = None
    if args.save:
        t0 = time.perf_counter()
        compiled.save(args.save, weights=False)
        save_s = round(time.perf_counter() - t0, 2)
    result = {"layers": args.layers, "target": args.target, "density": args.density, "block": args.block,
              "bits": args.bits, "save_s": save_s, "compile_peak_rss_gib": round(compile_rss, 2),
              "tokens": args.tokens, "vocab": args.vocab, "meta": args.meta, "cache": "cold" if cold else "warm",
              "compile_s": round(wall, 2), "timings_s": {k: round(v, 2) for k, v in compiled.timings.items()},
              "model_build_s": round(model_s, 2), "model_peak_rss_gib": round(model_rss, 2),
              "peak_rss_gib": round(peak_rss_gib(), 2), "kernels": len(compiled.kernels),
              "kernels_built": sum(1 for r in compiled.kernels if r.get("cached") is False),
              "cpus": os.cpu_count(), "torch": torch.__version__}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
