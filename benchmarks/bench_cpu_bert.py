"""End-to-end BERT-base on the CPU: 90% block-sparse linears, sparta vs torch dense eager.

    python benchmarks/bench_cpu_bert.py                  # batch 8 x seq 128, 12 layers

Every encoder linear (Q, K, V, attention output, FFN1, FFN2) is pruned to 90% in 32×32
blocks. Peers in the same process on the same inputs: the original dense model
(eager), the masked dense model (eager; what sparta must reproduce), and sparta's
compiled model. Outputs are verified against the masked dense model.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import transformers
from common import interleaved, save

import sparta
from sparta import TeSA


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache", help="kernel cache folder (default: a fresh one, so the first compile is cold)")
    ap.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)  # the warm run, in a new process
    args = ap.parse_args()
    if args.cache is None:
        args.cache = tempfile.mkdtemp(prefix="sparta_bench_cache_")
    os.environ["SPARTA_CACHE"] = args.cache
    model, ids, tesa = build(args)
    if args.compile_only:
        t0 = time.perf_counter()
        compiled = sparta.compile(model, tesa, (ids,))
        print(json.dumps({"compile_s": time.perf_counter() - t0, "timings": compiled.timings,
                          "cache_hits": sum(k["cached"] for k in compiled.kernels)}))
        return
    masked = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in masked.named_parameters():
            if name in tesa:
                p.mul_(tesa[name].mask)
    t0 = time.perf_counter()
    compiled = sparta.compile(model, tesa, (ids,))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled.verify()
    verify_s = time.perf_counter() - t0
    warm = subprocess.run([sys.executable, __file__, "--compile-only", "--cache", args.cache,
                           "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq),
                           "--sparsity", str(args.sparsity)], capture_output=True, text=True, check=True)
    warm = json.loads(warm.stdout.strip().splitlines()[-1])

    with torch.no_grad():
        got, want = compiled(ids).last_hidden_state, masked(ids).last_hidden_state
        err = ((got - want).abs().max() / want.abs().max()).item()
        t = interleaved({"sparta": lambda: compiled(ids), "dense": lambda: model(ids),
                         "masked_dense": lambda: masked(ids)}, args.reps)
    kinds = {}
    for p in compiled.plan.ops.values():
        if p.gemm:
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
    print(f"BERT-base {args.layers} layers, {args.batch}x{args.seq}, {args.sparsity:.0%} block-sparse linears, "
          f"{torch.get_num_threads()} threads")
    print(f"  sparta {t['sparta']:.1f} ms | torch dense eager {t['dense']:.1f} ms | masked dense {t['masked_dense']:.1f} ms"
          f" | speedup x{t['dense'] / t['sparta']:.2f} | max rel err vs masked dense {err:.2e}")
    print(f"  plans: {kinds}; cold compile {compile_s:.1f} s "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in compiled.timings.items())}); "
          f"kernels {len(compiled.kernels)} ({len({k['key'] for k in compiled.kernels})} distinct); "
          f"warm compile (new process) {warm['compile_s']:.1f} s "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in warm['timings'].items())}); verify {verify_s:.1f} s")
    path = save("cpu_bert", {"layers": args.layers, "batch": args.batch, "seq": args.seq, "sparsity": args.sparsity,
                             "times_ms": t, "speedup": t["dense"] / t["sparta"], "max_rel_err": err,
                             "compile_s": compile_s, "timings": compiled.timings, "plans": kinds,
                             "warm_compile_s": warm["compile_s"], "warm_timings": warm["timings"],
                             "verify_s": verify_s,
                             "kernels": compiled.kernels})
    print("wrote", path)


def build(args):
    """BERT-base from config (random init) and a 90%-style block TeSA on every encoder linear."""
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers)).eval()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    gen = torch.Generator().manual_seed(0)
    tesa = {}
    for name, p in model.named_parameters():
        if name.startswith("encoder.") and name.endswith(".weight") and p.dim() == 2:
            keep = torch.rand(p.shape[0] // 32, p.shape[1] // 32, generator=gen) >= args.sparsity
            tesa[name] = TeSA.from_mask(keep.repeat_interleave(32, 0).repeat_interleave(32, 1))
    return model, ids, tesa


if __name__ == "__main__":
    main()
