"""Fine-grained (unstructured) sparse fp16 linear on BERT-base FFN shapes (4096 tokens): sparta's CSR
kernel (``templates/cuda_fine.py``) against fp16 cuBLAS dense and cuSPARSE CSR, in one process.

    python benchmarks/build_cuda_kernels.py          # here (TVM + nvcc): artifacts/cuda/fine_*
    python benchmarks/bench_cuda_fine.py             # on the GPU machine

Random unstructured masks at 90–99% sparsity (at these densities every 32×32 block holds a kept
element, so block-sparse kernels cannot skip anything). Kernel-only: CUDA graphs over 4 rotated
input/weight sets; eager: host wall time per call. Floor: bytes (X, Y, CSR values + column indices)
at the measured copy bandwidth.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_cuda_bsr import SETS, ceilings, measure  # noqa: E402  (benchmarks/ is the script's folder)
from common import save  # noqa: E402
from sparta.runtime.fine_linear import FineLinearOp
from sparta.templates.cuda_fine import FineSpec, reference

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
SHAPES = {"ffn1": (4096, 3072, 768), "ffn2": (4096, 768, 3072)}


def main():
    bw, peak = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s", flush=True)
    rows = []
    for shape, (m, n, k) in SHAPES.items():
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(SETS)]
        ws = [torch.randn(n, k, device="cuda").half() for _ in range(SETS)]
        ys = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(SETS)]
        b = torch.randn(n, device="cuda").half()
        for sp in (90, 95, 98, 99):
            g = torch.Generator(device="cuda").manual_seed(sp)
            keeps = [torch.rand(n, k, device="cuda", generator=g) >= sp / 100 for _ in range(SETS)]
            fns = {"cublas": lambda i: F.linear(xs[i], ws[i], b)}
            errs = {}
            for folder in sorted(ROOT.glob(f"fine_{shape}*")):
                spec = FineSpec(**json.loads((folder / "spec.json").read_text()))
                ops = [FineLinearOp(folder, spec, ws[i], keeps[i], b) for i in range(SETS)]
                ops[0](xs[0], out=ys[0])
                ref = reference(xs[0], ws[0], keeps[0], b, "none").float()
                errs[folder.name] = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
                fns[folder.name] = (lambda ops: lambda i: ops[i](xs[i], out=ys[i]))(ops)
            csrs = [(w * kp).to_sparse_csr() for w, kp in zip(ws, keeps)]
            fns["cusparse_csr"] = lambda i: torch.sparse.mm(csrs[i], xs[i].t())
            res = measure(fns, SETS)
            nnz = sum(int(kp.sum()) for kp in keeps) / SETS
            floor = (2 * m * k + 2 * m * n + 6 * nnz) / bw / 1e3
            base = res["cublas"]["kernel_us"]
            for name, r in res.items():
                if "kernel_us" in r:
                    r["speedup_kernel"] = base / r["kernel_us"]
                r["max_rel_err"] = errs.get(name)
            best = min((v["kernel_us"], k_) for k_, v in res.items() if k_.startswith("fine") and "kernel_us" in v)
            rows.append({"shape": shape, "m": m, "n": n, "k": k, "sparsity": sp, "nnz": nnz, "floor_us": floor,
                         "results": res})
            print(f"{shape} {sp}% unstructured: cuBLAS {base:.1f} us | sparta {best[1]} {best[0]:.1f} us "
                  f"x{base / best[0]:.2f} | cuSPARSE x{res['cusparse_csr'].get('speedup_kernel', float('nan')):.2f} "
                  f"| floor x{base / floor:.2f}", flush=True)
    print(f"wrote {save('cuda_fine', {'copy_GBps': bw, 'rows': rows})}")


if __name__ == "__main__":
    main()
