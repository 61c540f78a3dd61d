"""Weight-only low bits on the CPU where they pay: a decode step of a LLaMA-style decoder, 8- and 4-bit weights.

    python benchmarks/bench_cpu_decode.py                       # 1 token, 4 layers, bits 8 and 4
    python benchmarks/bench_cpu_decode.py --tokens 1 4 16 --bits 8

A LLaMA-style decoder from its config (hidden 2048, intermediate 5632, 16 heads, 4 layers, random weights; fp32: its
weights, 0.8 GB, stream from memory on every call), called on ``--tokens`` positions without a KV cache (the GEMMs
of a decode step of that many sequences). Every linear weight of the layers gets a TeSA of ``--bits`` (no
calibration: scales fitted to each weight); activations stay fp32. Peers in one process, calls interleaved, medians:
the fp32 model in torch eager, ``torch.compile`` of it (Inductor, default mode), and sparta's compiled model, whose plan chooses per linear between the vendor fp32 GEMM
and sparta's weight-only kernel by its cost model (the plan report says which ran). Outputs are compared with the
model on the weights as the kernels apply them.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from common import interleaved, save

import sparta


def build(layers: int):
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                   num_attention_heads=16, num_key_value_heads=16, vocab_size=32000, use_cache=False)
    return transformers.LlamaModel(cfg).eval()


def run(model, inductor, tokens: int, bits: int, reps: int) -> dict:
    ids = torch.randint(0, 32000, (tokens, 1))
    tesa = {n: sparta.TeSA.dense(tuple(p.shape), bits=bits) for n, p in model.named_parameters()
            if p.dim() == 2 and "embed" not in n}
    t0 = time.perf_counter()
    compiled = sparta.compile(model, tesa, (ids,))
    compile_s = time.perf_counter() - t0
    compiled.verify()
    kernels = {}
    for p in compiled.plan.ops.values():
        if p.gemm is not None:
            key = p.kernel.describe() if p.kernel is not None else "vendor fp32"
            kernels[key] = kernels.get(key, 0) + 1
    with torch.no_grad():
        inductor(ids)                   # compiled for this shape before the timed calls
        ms = interleaved({"eager": lambda: model(ids), "torch_compile": lambda: inductor(ids),
                          "sparta": lambda: compiled(ids)}, reps)
    est = compiled.plan.est_us() / 1e3
    return {"tokens": tokens, "bits": bits, "eager_ms": ms["eager"], "torch_compile_ms": ms["torch_compile"],
            "sparta_ms": ms["sparta"], "speedup": ms["eager"] / ms["sparta"],
            "torch_compile_speedup": ms["torch_compile"] / ms["sparta"], "plan_est_ms": est, "gemm_kernels": kernels,
            "compile_s": compile_s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="*", type=int, default=[1])
    ap.add_argument("--bits", nargs="*", type=int, default=[8, 4])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build(args.layers)
    inductor = torch.compile(model)
    rows = []
    for bits in args.bits:
        for tokens in args.tokens:
            row = run(model, inductor, tokens, bits, args.reps)
            rows.append(row)
            print(f"W{bits}A32 tokens {tokens:3d}  eager {row['eager_ms']:7.2f} ms  torch.compile "
                  f"{row['torch_compile_ms']:7.2f} ms  sparta {row['sparta_ms']:7.2f} ms  {row['speedup']:.2f}x eager, "
                  f"{row['torch_compile_speedup']:.2f}x torch.compile  (plan est {row['plan_est_ms']:.2f} ms)  "
                  f"{row['gemm_kernels']}", flush=True)
    print(save("cpu_decode", {"rows": rows}))


if __name__ == "__main__":
    main()
