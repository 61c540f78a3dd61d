"""sparta's per-token int8 quantiser (``templates/quant/``) vs torch ops, against the copy floor.

    python benchmarks/build_cuda_kernels.py --only q_ffn1 q_ffn2     # machine with TVM + nvcc (no GPU needed)
    python benchmarks/bench_cuda_quant.py                            # GPU machine (torch + cuda-bindings)

The W8A8 linears' inputs at BERT-base's shapes (4096 tokens × 768: Q/K/V/O and FFN1; × 3072: FFN2), which
a model pays where no LayerNorm hands the linear its codes. Kernel-only time through CUDA graphs rotating
inputs beyond the 50 MB L2; floor = (2 bytes read + 1 byte written per element + 4 per row) / copy bandwidth.
Outputs checked bit for bit against ``quant.spec.quantize_rows``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_cuda_bsr import ROOT, copy_bandwidth  # noqa: E402
from common import gpu_kernel_us, save  # noqa: E402

from sparta.templates.quant.runtime import RowQuantizer  # noqa: E402
from sparta.templates.quant.spec import quantize_rows  # noqa: E402

SHAPES = {"q_ffn1": (4096, 768), "q_ffn2": (4096, 3072)}


def main():
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    rows = []
    for name, (m, k) in SHAPES.items():
        nbytes = 3 * m * k + 4 * m
        sets = max(2, math.ceil(120e6 / nbytes))
        xs = [(torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 8).half() for _ in range(sets)]
        quantizer = RowQuantizer(ROOT / name)
        xq, xs_ = quantizer(xs[0])
        rq, rs = quantize_rows(xs[0])
        exact = bool(torch.equal(xq, rq) and torch.equal(xs_, rs))
        res = {"sparta": {"kernel_us": gpu_kernel_us(lambda i: quantizer(xs[i]), sets), "bit_exact": exact},
               "torch_ops": {"kernel_us": gpu_kernel_us(lambda i: quantize_rows(xs[i]), sets)}}
        floor = nbytes / bw / 1e3
        for r in res.values():
            r["x_floor"] = r["kernel_us"] / floor
        rows.append({"shape": name, "m": m, "k": k, "bytes": nbytes, "floor_us": floor, "results": res})
        print(f"{name} {m}x{k}: floor {floor:.2f} us | sparta {res['sparta']['kernel_us']:.2f} us "
              f"({res['sparta']['x_floor']:.2f}x floor, bit exact {exact}) | torch ops "
              f"{res['torch_ops']['kernel_us']:.2f} us", flush=True)
    print(f"wrote {save('cuda_quant', {'copy_GBps': bw, 'rows': rows})}")


if __name__ == "__main__":
    main()
