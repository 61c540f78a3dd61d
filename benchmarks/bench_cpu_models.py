"""Seven transformers on the CPU, every linear block-sparse: sparta against torch eager, end to end.

    python benchmarks/bench_cpu_models.py                        # 90%, default environment
    python benchmarks/bench_cpu_models.py --sparsity 0.5 0.7 0.9 --models bert gpt2

Models from Hugging Face configs (random weights): BERT-base, DistilBERT, GPT-2, a LLaMA-style decoder (hidden 2048,
intermediate 5632, 4 layers), ViT-base, the T5 encoder (t5-small config), the BART-base encoder. Every linear weight
of the blocks (attention and MLP; not embeddings or heads) keeps a random (1 - sparsity) of its 32×32 blocks. Inputs:
batch 1 × 128 tokens (ViT: one 224×224 image). Peers in one process: the masked dense model in eager torch (what
sparta must reproduce: outputs are compared) and sparta's compiled model, calls interleaved, medians; with
``--compile``, also ``torch.compile`` (Inductor, default mode) of each: the dense model's best option and sparta's
third stage on the CPU. Each ``--threads`` mode runs in a process of its own (``SPARTA_CPU_THREADS``: ``openmp``,
the default, or ``tvm``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import transformers
from common import bench_mask, interleaved, save

import sparta

MODELS = ("bert", "distilbert", "gpt2", "llama", "vit", "t5", "bart")


def build(name: str):
    """(model, example inputs) for ``name``."""
    t = transformers
    ids = torch.randint(0, 1000, (1, 128))
    if name == "bert":
        return t.BertModel(t.BertConfig()), (ids,)
    if name == "distilbert":
        return t.DistilBertModel(t.DistilBertConfig()), (ids,)
    if name == "gpt2":
        return t.GPT2Model(t.GPT2Config(use_cache=False)), (ids,)
    if name == "llama":
        cfg = t.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                            num_key_value_heads=16, vocab_size=32000, use_cache=False)
        return t.LlamaModel(cfg), (ids,)
    if name == "vit":
        return t.ViTModel(t.ViTConfig(), add_pooling_layer=False), (torch.randn(1, 3, 224, 224),)
    if name == "t5":
        return t.T5EncoderModel(t.T5Config()), (ids,)
    if name == "bart":
        cfg = t.BartConfig(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                           decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)
        return t.BartModel(cfg).get_encoder(), (ids,)
    raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def block_masks(model, sparsity: float) -> dict:
    """A random 32×32 block mask per linear weight of the model's blocks (seeded by name)."""
    masks = {}
    for name, p in model.named_parameters():
        if p.dim() != 2 or "embed" in name or "wte" in name or "wpe" in name or "shared" in name:
            continue
        rows, cols = p.shape
        if rows % 32 or cols % 32:
            continue
        grid = bench_mask(rows // 32, cols // 32, 1 - sparsity, name)
        masks[name] = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)
    return masks


def first_tensor(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def run(name: str, sparsity: float, reps: int, with_compile: bool = False) -> dict:
    torch.manual_seed(0)
    model, inputs = build(name)
    model.eval()
    masks = block_masks(model, sparsity)
    t0 = time.perf_counter()
    compiled = sparta.compile(model, masks, inputs)
    compile_s = time.perf_counter() - t0
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, m in masks.items():
            params[n].mul_(m)
        ref, got = first_tensor(model(*inputs)), first_tensor(compiled(*inputs))
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        peers = {"eager": lambda: model(*inputs), "sparta": lambda: compiled(*inputs)}
        if with_compile:
            dense_c, sparta_c = torch.compile(model), torch.compile(compiled, fullgraph=True)
            t0 = time.perf_counter()
            inductor_err = ((first_tensor(sparta_c(*inputs)) - ref).abs().max() / ref.abs().max()).item()
            dense_c(*inputs)
            inductor_s = time.perf_counter() - t0
            peers.update({"dense_compile": lambda: dense_c(*inputs), "sparta_compile": lambda: sparta_c(*inputs)})
        ms = interleaved(peers, reps)
    kernels = sum(1 for k in compiled.kernels)
    row = {"model": name, "sparsity": sparsity, "eager_ms": ms["eager"], "sparta_ms": ms["sparta"],
           "speedup": ms["eager"] / ms["sparta"], "rel_err": err, "linears": len(masks), "kernels": kernels,
           "compile_s": compile_s, "threads": os.environ.get("SPARTA_CPU_THREADS", "openmp")}
    if with_compile:
        row.update(dense_compile_ms=ms["dense_compile"], sparta_compile_ms=ms["sparta_compile"],
                   inductor_rel_err=inductor_err, inductor_compile_s=inductor_s,
                   speedup_vs_dense_compile=ms["dense_compile"] / min(ms["sparta"], ms["sparta_compile"]))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--sparsity", nargs="*", type=float, default=[0.9])
    ap.add_argument("--threads", nargs="*", default=["openmp"], choices=["openmp", "tvm"])
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--name", default="cpu_models", help="results/<name>-cpu-<date>.json")
    ap.add_argument("--compile", action="store_true", help="torch.compile peers: the dense model and sparta's")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)       # model sparsity, in a child process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run(args.one[0], float(args.one[1]), args.reps, args.compile)))
        return
    rows = []
    for mode in args.threads:
        for name in args.models:
            for s in args.sparsity:
                env = {**os.environ, "SPARTA_CPU_THREADS": mode}
                out = subprocess.run([sys.executable, __file__, "--one", name, str(s), "--reps", str(args.reps),
                                      *(["--compile"] if args.compile else [])], capture_output=True, text=True,
                                     env=env)
                if out.returncode:
                    error = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
                    rows.append({"model": name, "sparsity": s, "threads": mode, "error": error})
                    print(f"{mode:6s} {name:10s} {s:.0%}  failed: {error}", flush=True)
                    continue
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{mode:6s} {name:10s} {s:.0%}  eager {row['eager_ms']:7.1f} ms  sparta {row['sparta_ms']:7.1f} ms"
                      f"  {row['speedup']:.2f}x  rel err {row['rel_err']:.1e}"
                      + (f"  | torch.compile: dense {row['dense_compile_ms']:7.1f} ms  sparta "
                         f"{row['sparta_compile_ms']:7.1f} ms  ({row['speedup_vs_dense_compile']:.2f}x)"
                         if "dense_compile_ms" in row else ""), flush=True)
                path = save(args.name, {"rows": rows})
    print(path)


if __name__ == "__main__":
    main()
