"""sparta's dense CUDA GEMM template vs cuBLAS, on the GPU (kernels built beforehand, no TVM there).

    python benchmarks/build_cuda_kernels.py     # on the machine with TVM + nvcc
    python benchmarks/bench_cuda_gemm.py        # on the GPU machine

Kernel-only times from CUDA events over many launches, rotating among input buffers
larger than L2 together. Peers: cuBLAS ``F.linear`` (fp16 out) and ``torch.mm`` into an
fp32 output (what the template writes). Reports TFLOP/s and the ratio to cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from sparta.runtime.cuda import CudaKernel

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))


def time_us(fn, sets, iters=50):
    for s in sets:
        fn(*s)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(*sets[i % len(sets)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    index = json.loads((ROOT / "index.json").read_text())
    rows = []
    for name, s in index.items():
        if not (ROOT / name).is_dir() or s["m"] < 1024:
            continue
        kern = CudaKernel(ROOT / name)
        m, n, k = s["m"], s["n"], s["k"]
        per_set = 2 * (m * k + n * k) + 4 * m * n
        sets = [(torch.randn(m, k, device="cuda").half(), torch.randn(n, k, device="cuda").half(),
                 torch.empty(m, n, device="cuda")) for _ in range(max(2, (200 << 20) // per_set + 1))]
        order = [a["name"] for a in kern.launch["args"]]

        def sparta_fn(x, w, y):
            a = {"X": x, "W": w, "Y": y}
            kern(*[a[o] for o in order])

        x, w, y = sets[0]
        sparta_fn(x, w, y)
        torch.cuda.synchronize()
        err = ((y - x.float() @ w.float().t()).abs().max() / (x.float() @ w.float().t()).abs().max()).item()
        t_sparta = time_us(sparta_fn, sets)
        t_cublas = time_us(lambda x, w, y: torch.nn.functional.linear(x, w), sets)
        t_cublas32 = time_us(lambda x, w, y: torch.mm(x, w.t(), out_dtype=torch.float32), sets) \
            if "out_dtype" in torch.mm.__doc__ else float("nan")
        flops = 2 * m * n * k
        row = {"name": name, "m": m, "n": n, "k": k, "sparta_us": t_sparta, "cublas_us": t_cublas,
               "cublas_fp32out_us": t_cublas32, "sparta_tflops": flops / t_sparta / 1e6,
               "cublas_tflops": flops / t_cublas / 1e6, "ratio_vs_cublas": t_cublas / t_sparta, "max_rel_err": err}
        rows.append(row)
        print(f"{name} {m}x{n}x{k}: sparta {t_sparta:.1f} us ({row['sparta_tflops']:.0f} TFLOP/s) | "
              f"cuBLAS {t_cublas:.1f} us ({row['cublas_tflops']:.0f}) | x{row['ratio_vs_cublas']:.2f} of cuBLAS | "
              f"err {err:.1e}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
