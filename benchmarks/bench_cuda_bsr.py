"""sparta's block-sparse CUDA linear vs cuBLAS, torch BSR (Triton), cuSPARSE CSR and cuSPARSELt 2:4.

    python benchmarks/build_cuda_kernels.py          # machine with TVM + nvcc (no GPU needed)
    python benchmarks/bench_cuda_bsr.py [--quick]    # GPU machine (torch + cuda-bindings, no TVM)

BERT-base FFN1 (4096×768 → 3072) and FFN2 (4096×3072 → 768), fp16, bias fused, at
50/70/90/95% block sparsity in 32×32 and 64×64 blocks. Kernel-only time: CUDA graphs of 40
calls rotating input/output/weight sets larger than L2; eager: host clock per call. The
floor is max(bytes / measured copy bandwidth, kept flops / measured cuBLAS peak).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_mask, copy_bandwidth, gpu_kernel_us, gpu_wall_us, save  # noqa: E402

from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec  # noqa: E402
from sparta.templates.bsr_linear.spec import reference  # noqa: E402

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
SHAPES = {"ffn1": (4096, 3072, 768), "ffn2": (4096, 768, 3072)}
SETS = 4        # rotating input sets: 4 × (X + Y) ≥ 125 MB for FFN1, beyond the 50-60 MB L2



def ceilings() -> tuple[float, float]:
    """(copy bandwidth GB/s counting read + write, cuBLAS fp16 TFLOP/s at 8192³)."""
    x = torch.randn(8192, 8192, device="cuda").half()
    us_mm = gpu_kernel_us(lambda i: x @ x, 1, per_graph=10)
    return copy_bandwidth(), 2 * 8192 ** 3 / us_mm / 1e6


def expand(mask, bn, bk, n, k):
    return mask.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]


def measure(fns: dict, variants: int) -> dict:
    out = {}
    for name, fn in fns.items():
        try:
            out[name] = {"kernel_us": gpu_kernel_us(fn, variants), "eager_us": gpu_wall_us(fn, variants)}
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this case is reported, not fatal
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return out


def dense_rows(bw, peak):
    rows = []
    for shape, (m, n, k) in SHAPES.items():
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(SETS)]
        w = torch.randn(n, k, device="cuda").half()
        b = torch.randn(n, device="cuda").half()
        ys = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(SETS)]
        fns = {"cublas": lambda i: F.linear(xs[i], w, b)}
        errs = {}
        for folder in sorted(ROOT.glob(f"{shape}_t*")):
            spec = load_spec(folder)
            op = BsrLinearOp(folder, spec, w, torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool), b)
            op(xs[0], out=ys[0])
            ref = F.linear(xs[0].float(), w.float(), b.float())
            errs[folder.name] = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
            fns[folder.name] = (lambda op: lambda i: op(xs[i], out=ys[i]))(op)
        res = measure(fns, SETS)
        floor = max((2 * (m * k + n * k + m * n)) / bw / 1e3, 2 * m * n * k / peak / 1e6)
        for name, r in res.items():
            if "kernel_us" in r:
                r["tflops"] = 2 * m * n * k / r["kernel_us"] / 1e6
                r["vs_cublas"] = res["cublas"]["kernel_us"] / r["kernel_us"]
            r["max_rel_err"] = errs.get(name)
        rows.append({"shape": shape, "m": m, "n": n, "k": k, "floor_us": floor, "results": res})
        print("  " + " ".join(f"{k_}={v['tflops']:.0f}" for k_, v in res.items() if "tflops" in v))
        best = max((v["tflops"], k_) for k_, v in res.items() if k_ != "cublas" and "tflops" in v)
        print(f"dense {shape}: cuBLAS {res['cublas']['kernel_us']:.1f} us ({res['cublas']['tflops']:.0f} TFLOP/s); "
              f"best sparta {best[1]} {best[0]:.0f} TFLOP/s = {best[0] / res['cublas']['tflops']:.2f}x", flush=True)
    return rows


def sparse_rows(bw, peak, sparsities, blocks):
    rows = []
    for shape, (m, n, k) in SHAPES.items():
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(SETS)]
        ys = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(SETS)]
        b = torch.randn(n, device="cuda").half()
        ws = [torch.randn(n, k, device="cuda").half() for _ in range(SETS)]
        for blk in blocks:
            for sp in sparsities:
                density = 1 - sp / 100
                masks = [bench_mask(-(-n // blk), -(-k // blk), density, f"{shape}-{blk}-{sp}-{i}") for i in range(SETS)]
                configs = {f.name: [f] * SETS for f in sorted(ROOT.glob(f"{shape}_b{blk}_t*")) if "c_sp" not in f.name}
                for f in sorted(ROOT.glob(f"{shape}_b{blk}_t*c_sp{sp}_s0")):      # patterns baked in
                    configs[f.name[: -len("_s0")]] = [f.parent / f"{f.name[:-1]}{i}" for i in range(SETS)]
                wm = [w * expand(mk, blk, blk, n, k).to(w.device) for w, mk in zip(ws, masks)]
                fns = {"cublas": lambda i: F.linear(xs[i], ws[i], b)}
                errs = {}
                for cname, set_folders in configs.items():
                    ops = [BsrLinearOp(f, load_spec(f), ws[i], masks[i], b) for i, f in enumerate(set_folders)]
                    ops[0](xs[0], out=ys[0])
                    ref = reference(xs[0], ws[0], masks[0], b, "none", blk, blk).float()
                    key = f"sparta_{cname.split('_', 1)[1].replace(f'_sp{sp}', '')}"
                    errs[key] = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
                    fns[key] = (lambda ops: lambda i: ops[i](xs[i], out=ys[i]))(ops)
                try:
                    from torch.sparse._triton_ops import bsr_dense_mm
                    bsrs = [x.to_sparse_bsr((blk, blk)) for x in wm]
                    fns["torch_bsr"] = lambda i: bsr_dense_mm(bsrs[i], xs[i].t())
                except Exception as exc:  # noqa: BLE001
                    errs["torch_bsr"] = f"{type(exc).__name__}: {exc}"
                try:
                    csrs = [x.to_sparse_csr() for x in wm]
                    fns["cusparse_csr"] = lambda i: torch.sparse.mm(csrs[i], xs[i].t())
                except Exception as exc:  # noqa: BLE001
                    errs["cusparse_csr"] = f"{type(exc).__name__}: {exc}"
                if sp == 50:
                    try:
                        w24 = [x * torch.tensor([1, 1, 0, 0], device="cuda", dtype=x.dtype).repeat(n, k // 4) for x in ws]
                        comp = [torch._cslt_compress(x) for x in w24]
                        fns["cusparselt_2:4"] = lambda i: torch._cslt_sparse_mm(comp[i], xs[i].t())
                    except Exception as exc:  # noqa: BLE001
                        errs["cusparselt_2:4"] = f"{type(exc).__name__}: {exc}"
                res = measure(fns, SETS)
                kept = sum(int(mk.sum()) for mk in masks) / SETS
                bytes_ = 2 * (m * k + m * n + kept * blk * blk + n)
                floor = max(bytes_ / bw / 1e3, 2 * m * kept * blk * blk / peak / 1e6)
                for name, r in res.items():
                    if "kernel_us" in r:
                        r["speedup_kernel"] = res["cublas"]["kernel_us"] / r["kernel_us"]
                        r["speedup_eager"] = res["cublas"]["eager_us"] / r["eager_us"]
                    if not isinstance(errs.get(name), str):
                        r["max_rel_err"] = errs.get(name)
                for name, e in errs.items():
                    if isinstance(e, str):
                        res[name] = {"error": e}
                row = {"shape": shape, "block": blk, "sparsity": sp, "density": kept / masks[0].numel(),
                       "floor_us": floor, "floor_speedup": res["cublas"]["kernel_us"] / floor, "results": res}
                rows.append(row)
                sp_best = min((v["kernel_us"], k_) for k_, v in res.items() if k_.startswith("sparta") and "kernel_us" in v)
                print("  " + " ".join(f"{k_}={v['kernel_us']:.1f}" for k_, v in res.items() if "kernel_us" in v))
                print(f"{shape} {blk}x{blk} {sp}%: cuBLAS {res['cublas']['kernel_us']:.1f} us | "
                      f"{sp_best[1]} {sp_best[0]:.1f} us x{res['cublas']['kernel_us'] / sp_best[0]:.2f} "
                      f"(eager x{res[sp_best[1]]['speedup_eager']:.2f}) | floor x{row['floor_speedup']:.2f} | " +
                      " ".join(f"{k_} x{v['speedup_kernel']:.2f}" for k_, v in res.items()
                               if not k_.startswith(("sparta", "cublas")) and "speedup_kernel" in v), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="90% only, 32x32 blocks")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--sparsities", type=int, nargs="*", help="default 50 70 90 95")
    ap.add_argument("--blocks", type=int, nargs="*", help="default 32 64")
    args = ap.parse_args()
    bw, peak = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s, cuBLAS 8192^3 {peak:.0f} TFLOP/s", flush=True)
    dense = [] if args.no_dense else dense_rows(bw, peak)
    sparse = sparse_rows(bw, peak, args.sparsities or ([90] if args.quick else [50, 70, 90, 95]),
                         args.blocks or ([32] if args.quick else [32, 64]))
    path = save("cuda_bsr", {"copy_GBps": bw, "cublas_peak_tflops": peak, "dense": dense, "sparse": sparse})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
