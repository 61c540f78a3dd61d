"""What the memory system gives for the BERT FFN byte patterns: the practical floor of a sparse linear.

    python benchmarks/bench_stream_floor.py          # GPU machine

At 90% block sparsity a BERT FFN linear is bound by moving its dense input and output (FFN1:
read 6.3 MB, write 25 MB; FFN2 the other way round). The floor in bench_cuda_bsr.py divides
those bytes by the copy bandwidth; this measures torch's own streaming kernels on the same
patterns (rotating buffers beyond L2, CUDA graphs), so a kernel's distance to the floor can be
split into what the memory system cannot give and what the kernel leaves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_cuda_bsr import SETS, SHAPES, copy_bandwidth  # noqa: E402
from common import gpu_kernel_us, save  # noqa: E402


def patterns(m: int, n: int, k: int) -> dict:
    """name -> (fn(i), bytes moved) on rotating (X, Y) sets."""
    xs = [torch.randn(m, k, device="cuda").half() for _ in range(SETS)]
    ys = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(SETS)]
    b = torch.randn(n, device="cuda").half()
    out = {"write Y (fill)": (lambda i: ys[i].fill_(1.0), 2 * m * n),
           "write Y (bias rows)": (lambda i: ys[i].copy_(b.expand(m, n)), 2 * m * n),
           "read X (sum)": (lambda i: xs[i].sum(dtype=torch.float32), 2 * m * k)}
    if n % k == 0:      # FFN1: every X row read once, Y written as X repeated
        out["read X + write Y (cat)"] = (lambda i: torch.cat([xs[i]] * (n // k), 1, out=ys[i]), 2 * (m * k + m * n))
    elif k % n == 0:    # FFN2: X read, Y written as a sum of X's column groups
        out["read X + write Y (group sum)"] = (
            lambda i: torch.sum(xs[i].view(m, k // n, n), 1, out=ys[i]), 2 * (m * k + m * n))
    return out


def main():
    copy_bw = copy_bandwidth()
    print(f"copy 256 MiB: {copy_bw:.0f} GB/s (read + write)")
    rows = []
    for shape, (m, n, k) in SHAPES.items():
        floor_us = 2 * (m * k + m * n) / copy_bw / 1e3
        for name, (fn, nbytes) in patterns(m, n, k).items():
            us = gpu_kernel_us(fn, SETS)
            rows.append({"shape": shape, "pattern": name, "kernel_us": us, "bytes": nbytes,
                         "gb_s": nbytes / us / 1e3, "copy_floor_us": floor_us})
            print(f"{shape} {name}: {us:.2f} us, {nbytes / us / 1e3:.0f} GB/s (copy floor of X + Y {floor_us:.2f} us)",
                  flush=True)
    print(save("stream_floor", {"copy_gb_s": copy_bw, "rows": rows}))


if __name__ == "__main__":
    main()
