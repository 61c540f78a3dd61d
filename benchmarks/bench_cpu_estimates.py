"""The CPU plan's estimates against the measured time of each GEMM it plans, op by op.

    python benchmarks/bench_cpu_estimates.py                        # BERT-base and the LLaMA-style decoder
    python benchmarks/bench_cpu_estimates.py --models bert --sparsity 0.5 0.7 0.9

Models and masks as ``bench_cpu_models.py`` (random 32×32 block masks, batch 1 × 128 tokens). For every GEMM of the
plan: its estimate (``OpPlan.est_us``) and the time of what runs it, alone, on a random input of the captured shape
(the least disturbed of ``--rounds`` medians of ``--reps`` calls, as the profile measures its costs): sparta's kernel
module for a sparse plan, the torch op on the masked weight for a dense one. Up to three ops of one estimate are
measured and their median kept.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_cpu_models import block_masks, build
from common import interleaved, save

import sparta
from sparta.passes.transform import gemm_bias, gemm_view


def op_runner(compiled, op_plan):
    """A call of what runs ``op_plan``'s op, on a fresh random input of its captured shape."""
    graph = compiled.graph
    op = graph.op(op_plan.op)
    x_name, w_name, *_ = gemm_view(graph, op)
    x = torch.randn(graph.tensor(x_name).shape)
    module = compiled.module_replacements().get(op.name)
    if module is not None:
        return lambda: module(x)
    w = compiled._reference_weights.get(w_name, graph.tensor(w_name).data)
    bias_name = gemm_bias(op)
    b = graph.tensor(bias_name).data if bias_name else None
    if op.op == "linear":
        return lambda: torch.nn.functional.linear(x, w, b)
    if op.op == "addmm":
        return lambda: torch.addmm(b, x, w)
    return lambda: torch.matmul(x, w)


def run(name: str, sparsity: float, reps: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    model, inputs = build(name)
    model.eval()
    compiled = sparta.compile(model, block_masks(model, sparsity), inputs)
    groups = {}
    for p in compiled.plan.ops.values():
        if p.gemm is None or p.kind == "torch":
            continue
        key = (p.gemm, p.kind, round(p.est_us, 1))
        groups.setdefault(key, []).append(p)
    rows = []
    with torch.no_grad():
        for (gemm, kind, est), plans in groups.items():
            # each op: the least disturbed of ``rounds`` medians, the statistic the profile's costs are measured with
            measured = [min(interleaved({"op": op_runner(compiled, p)}, reps)["op"] for _ in range(rounds)) * 1e3
                        for p in plans[:3]]
            us = statistics.median(measured)
            rows.append({"model": name, "sparsity": sparsity, "ops": len(plans), "example": plans[0].op,
                         "gemm": list(gemm), "kind": kind, "density": plans[0].density,
                         "kernel": plans[0].kernel.describe() if plans[0].kernel else "vendor",
                         "est_us": est, "measured_us": us, "ratio": us / est})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["bert", "llama"])
    ap.add_argument("--sparsity", nargs="*", type=float, default=[0.5, 0.7, 0.9])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2, help="medians per op; the least disturbed is kept")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        for s in args.sparsity:
            for r in run(name, s, args.reps, args.rounds):
                rows.append(r)
                ok = "ok" if 1 / 1.3 <= r["ratio"] <= 1.3 else "OFF"
                print(f"{name:6s} {s:.0%} {r['example']:28s} {str(r['gemm']):18s} {r['kind']:6s} "
                      f"est {r['est_us']:8.1f}  measured {r['measured_us']:8.1f} µs  x{r['ratio']:.2f} {ok}",
                      flush=True)
    within = sum(1 / 1.3 <= r["ratio"] <= 1.3 for r in rows)
    print(f"{within}/{len(rows)} op shapes within 30% of their estimate")
    print(save("cpu_estimates", {"rows": rows, "within_30pct": within, "shapes": len(rows)}))


if __name__ == "__main__":
    main()
