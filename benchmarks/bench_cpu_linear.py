"""BERT-base FFN linears on the CPU: sparta's kernels vs torch dense and torch sparse, side by side.

    python benchmarks/bench_cpu_linear.py            # FFN1 and FFN2, 4096 tokens, all sparsities

For each case the same inputs go through: sparta (the compiled ``nn.Linear``: plan,
specialised TVM kernel), ``F.linear`` on the masked dense weight (MKL/oneDNN),
``torch.sparse.mm`` on CSR and on BSR(32×32). Reported: median ms, speedup over dense,
effective GFLOP/s on the kept weights, and the roofline floor (kept flops at the
measured dense peak; bytes of X + kept W + Y at the measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from common import interleaved, save

import sparta
from sparta import TeSA


def median_ms(fn, reps):
    return interleaved({"f": fn}, reps)["f"]


def block_mask(n, k, block, density, gen):
    keep = torch.rand(n // block, k // block, generator=gen) < density
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)


def copy_bandwidth_gbs():
    big = torch.empty(256 << 20, dtype=torch.uint8)
    big.fill_(1)
    ms = median_ms(lambda: big.clone(), 5)
    return 2 * big.numel() / (ms * 1e6)


def run_case(name, m, n, k, pattern, density, reps, peak_gflops, bw_gbs, gen):
    mask = block_mask(n, k, 32, density, gen) if pattern == "block32" else torch.rand(n, k, generator=gen) < density
    lin = torch.nn.Linear(k, n, bias=False).eval()
    x = torch.randn(m, k, generator=gen)
    t0 = time.perf_counter()
    compiled = sparta.compile(lin, {"weight": TeSA.from_mask(mask)}, (x,), verify=True)
    compile_s = time.perf_counter() - t0
    w = (lin.weight * mask).detach()
    csr, bsr = w.to_sparse_csr(), w.to_sparse_bsr((32, 32))
    xt = x.t().contiguous()
    kernel = next((m for m in compiled.module.modules() if hasattr(m, "subs")), None)
    y = torch.empty(m, n)

    def sparta_kernel_only():  # the sub-operator kernels into a preallocated output
        for i, sub in enumerate(kernel.subs):
            sub(x, y, None)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), x @ w.t(), rtol=1e-4, atol=1e-3)
        t = interleaved({"sparta": lambda: compiled(x), "dense": lambda: torch.nn.functional.linear(x, w),
                         "sparta_kernel": sparta_kernel_only if kernel else (lambda: compiled(x)),
                         "dense_kernel": lambda: torch.mm(x, w.t(), out=y)}, reps)
        t_sparta, t_dense = t["sparta"], t["dense"]
        t_csr = median_ms(lambda: torch.sparse.mm(csr, xt), max(2, reps // 2))
        t_bsr = median_ms(lambda: torch.sparse.mm(bsr, xt), max(2, reps // 2))
    kept = int(mask.sum())
    flops = 2 * m * kept
    nbytes = 4 * (m * k + kept + m * n)
    floor_ms = max(flops / (peak_gflops * 1e6), nbytes / (bw_gbs * 1e6))
    plan = compiled.plan[next(iter(p for p in compiled.plan.ops if compiled.plan[p].gemm))]
    row = {"case": name, "m": m, "n": n, "k": k, "pattern": pattern, "density": density, "kept": kept,
           "sparta_ms": t_sparta, "dense_ms": t_dense, "csr_ms": t_csr, "bsr_ms": t_bsr,
           "sparta_kernel_ms": t["sparta_kernel"], "dense_kernel_ms": t["dense_kernel"],
           "kernel_speedup_vs_dense": t["dense_kernel"] / t["sparta_kernel"],
           "speedup_vs_dense": t_dense / t_sparta, "speedup_vs_csr": t_csr / t_sparta,
           "speedup_vs_bsr": t_bsr / t_sparta, "sparta_gflops": flops / (t_sparta * 1e6),
           "floor_ms": floor_ms, "flops": flops, "bytes": nbytes, "compile_s": compile_s,
           "plan": plan.kind, "subops": [f"{s.template}{s.block}" for s in plan.subops],
           "kernels": compiled.kernels}
    print(f"{name:5s} {pattern:8s} {1 - density:4.0%}  sparta {t_sparta:7.2f} ms  dense {t_dense:7.2f}  "
          f"csr {t_csr:7.2f}  bsr {t_bsr:7.2f}  x{t_dense / t_sparta:5.2f} vs dense  "
          f"[kernel-only {t['sparta_kernel']:6.2f} vs {t['dense_kernel']:6.2f}: x{t['dense_kernel'] / t['sparta_kernel']:5.2f}]  "
          f"{row['sparta_gflops']:6.1f} GFLOP/s  floor {floor_ms:6.2f} ms  ({plan.kind}: {', '.join(row['subops'])}; "
          f"compile {compile_s:.1f} s)")
    return row


def dismantle_study(name, m, n, k, density, reps, gen):
    """The same 90% FFN weight built at each dismantle level: build seconds, code bytes, kernel ms."""
    mask = block_mask(n, k, 32, density, gen)
    lin = torch.nn.Linear(k, n, bias=False).eval()
    x = torch.randn(m, k, generator=gen)
    y = torch.empty(m, n)
    fns, info = {}, {}
    for mode in ("none", "tile", "full"):
        compiled = sparta.compile(lin, {"weight": TeSA.from_mask(mask)}, (x,), dismantle=mode, verify=True)
        kernel = next(mm for mm in compiled.module.modules() if hasattr(mm, "subs"))
        fns[mode] = (lambda kern: lambda: [sub(x, y, None) for sub in kern.subs])(kernel)
        info[mode] = {"build_s": sum(kk["build_s"] for kk in compiled.kernels),
                      "code_bytes": sum(kk["code_bytes"] for kk in compiled.kernels)}
    t = interleaved(fns, reps)
    for mode in fns:
        info[mode]["kernel_ms"] = t[mode]
    print(f"{name} {1 - density:.0%} dismantle: " + "  ".join(
        f"{mode} {v['kernel_ms']:.2f} ms (build {v['build_s']:.1f} s, {v['code_bytes'] / 1e3:.0f} kB)"
        for mode, v in info.items()))
    return {"case": name, "density": density, "m": m, "n": n, "k": k, "levels": info}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--cache", help="kernel cache folder (default: a fresh one, so build times are cold)")
    args = ap.parse_args()
    os.environ["SPARTA_CACHE"] = args.cache or tempfile.mkdtemp(prefix="sparta_bench_cache_")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024)
    w = torch.randn(1024, 1024)
    peak = 2 * 1024 ** 3 / (median_ms(lambda: x @ w, 9) * 1e6)
    bw = copy_bandwidth_gbs()
    print(f"threads {torch.get_num_threads()}, dense peak {peak:.0f} GFLOP/s, copy bandwidth {bw:.1f} GB/s")
    rows = []
    for name, n, k in (("FFN1", 3072, 768), ("FFN2", 768, 3072)):
        for sparsity in (0.5, 0.7, 0.9, 0.95):
            rows.append(run_case(name, args.tokens, n, k, "block32", 1 - sparsity, args.reps, peak, bw, gen))
        rows.append(run_case(name, args.tokens, n, k, "fine", 0.1, args.reps, peak, bw, gen))
    study = [dismantle_study(name, args.tokens, n, k, 0.1, args.reps, gen)
             for name, n, k in (("FFN1", 3072, 768), ("FFN2", 768, 3072))]
    path = save("cpu_linear", {"peak_gflops": peak, "bandwidth_gbs": bw, "rows": rows, "dismantle": study})
    print("wrote", path)


if __name__ == "__main__":
    main()
