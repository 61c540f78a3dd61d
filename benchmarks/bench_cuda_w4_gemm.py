"""sparta's W4A16 GEMM (``bsr_linear`` with ``dtype="w4a16"``: int4 blocks dequantised in registers by
``lop3`` into ``mma.sync`` fragments) vs fp16 cuBLAS and torch's tinygemm int4 kernel.

    python benchmarks/build_cuda_kernels.py        # machine with TVM + nvcc (no GPU needed)
    python benchmarks/bench_cuda_w4_gemm.py         # GPU machine (torch + cuda-bindings, no TVM)

Dense: N×K = 4096×4096, 11008×4096, 4096×11008 at M = 16, 64, 256, 1024, 4096 (symmetric int4, one
fp16 scale per 128 K), every built tile. Block-sparse: BERT-base FFN1/FFN2 (4096 tokens) at 50-95%
block sparsity, W4A16 vs sparta's fp16 kernel of the same tile and mask and vs cuBLAS dense.
Kernel-only time: CUDA graphs over rotated weight/input sets beyond L2. Floor = max(bytes moved
(int4 weights + scales + X + Y) / measured copy bandwidth, flops / cuBLAS fp16 peak).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_cuda_bsr import ceilings, measure  # noqa: E402  (benchmarks/ is the script's folder)
from bench_cuda_w4a16 import tinygemm  # noqa: E402
from common import bench_mask, save  # noqa: E402

from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec  # noqa: E402
from sparta.templates.bsr_linear.int4_records import dequantize_w4, expand_groups, pack_w4, quantize_w4  # noqa: E402
from sparta.templates.bsr_linear.spec import reference  # noqa: E402

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}
MS = (16, 64, 256, 1024, 4096)
FFN = {"ffn1": (4096, 3072, 768), "ffn2": (4096, 768, 3072)}
GROUP, ROTATE_BYTES = 128, 120e6


def _quantized(n, k, seed):
    torch.manual_seed(seed)
    w = torch.randn(n, k, device="cuda") * 0.05
    codes, scale, _ = quantize_w4(w, GROUP)
    return w, codes, scale, expand_groups(scale, GROUP, k)


def dense_rows(bw, peak):
    rows = []
    for shape, (n, k) in SHAPES.items():
        w, codes, scale, s_el = _quantized(n, k, n + k)
        deq = dequantize_w4(codes, s_el, None)
        wbytes = n * k // 2 + 2 * n * k // GROUP
        for m in MS:
            folders = sorted(ROOT.glob(f"w4g_{shape}_m{m}_*"))
            if not folders:
                continue
            sets = max(2, math.ceil(ROTATE_BYTES / wbytes))
            xs = [torch.randn(m, k, device="cuda").half() for _ in range(sets)]
            ys = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(sets)]
            ref = reference(xs[0], deq, None, None, "none", 1, 1).float()
            fns, errs = {}, {}
            for folder in folders:
                spec = load_spec(folder)
                wp, table = pack_w4(codes, s_el, None, spec, torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool))
                ops = [BsrLinearOp.packed(folder, spec, wp.clone(), table) for _ in range(sets)]
                ops[0](xs[0], out=ys[0])
                key = "sparta_" + folder.name.split(f"_m{m}_")[1]
                errs[key] = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
                fns[key] = (lambda ops: lambda i: ops[i](xs[i], out=ys[i]))(ops)
            try:
                fn, y, _ = tinygemm(codes, scale, torch.full_like(scale, 8, dtype=torch.uint8), xs, sets)
                fns["tinygemm"] = fn
                errs["tinygemm"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                errs["tinygemm"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            wf = [w.half() for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
            fns["cublas_fp16"] = lambda i: F.linear(xs[i % sets], wf[i % len(wf)])
            res = measure(fns, sets)
            floor = max((wbytes + 2 * m * (k + n)) / bw / 1e3, 2 * m * n * k / peak / 1e6)
            for key, r in res.items():
                if "kernel_us" in r:
                    r["x_floor"] = r["kernel_us"] / floor
                    r["vs_cublas"] = res["cublas_fp16"]["kernel_us"] / r["kernel_us"]
                e = errs.get(key)
                r["max_rel_err" if not isinstance(e, str) else "error"] = e
            best = min((v["kernel_us"], kk) for kk, v in res.items() if kk.startswith("sparta") and "kernel_us" in v)
            tg = res.get("tinygemm", {}).get("kernel_us")
            print(f"{shape} m={m}: floor {floor:.2f} us | sparta {best[1]} {best[0]:.2f} us ({best[0] / floor:.2f}x floor, "
                  f"{res[best[1]]['vs_cublas']:.2f}x cuBLAS) | tinygemm {f'{tg:.2f}' if tg else errs.get('tinygemm')} | "
                  f"cuBLAS fp16 {res['cublas_fp16']['kernel_us']:.2f} us", flush=True)
            rows.append({"shape": shape, "n": n, "k": k, "m": m, "group": GROUP, "floor_us": floor, "best": best[1],
                         "results": res})
    return rows


def sparse_rows(bw, peak, sparsities=(50, 70, 90, 95)):
    rows = []
    for shape, (m, n, k) in FFN.items():
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
        ys = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(4)]
        b = torch.randn(n, device="cuda").half()
        ws = [torch.randn(n, k, device="cuda").half() for _ in range(4)]
        for tile, blk in (("b32_t128w2", 32), ("b64_t128", 64)):
            w4_folder, f16_folder = ROOT / f"{shape}_w4_{tile}", ROOT / f"{shape}_{tile}"
            if not w4_folder.is_dir():
                continue
            for sp in sparsities:
                masks = [bench_mask(-(-n // blk), -(-k // blk), 1 - sp / 100, f"{shape}-{blk}-{sp}-{i}") for i in range(4)]
                w4 = [BsrLinearOp(w4_folder, load_spec(w4_folder), ws[i], masks[i], b) for i in range(4)]
                fns = {"cublas": lambda i: F.linear(xs[i], ws[i], b),
                       "sparta_w4a16": lambda i: w4[i](xs[i], out=ys[i])}
                if f16_folder.is_dir():
                    f16 = [BsrLinearOp(f16_folder, load_spec(f16_folder), ws[i], masks[i], b) for i in range(4)]
                    fns["sparta_fp16"] = lambda i: f16[i](xs[i], out=ys[i])
                w4[0](xs[0], out=ys[0])
                exact = reference(xs[0], ws[0], masks[0], b, "none", blk, blk).float()
                sqnr = 10 * math.log10(exact.pow(2).mean().item() / (ys[0].float() - exact).pow(2).mean().item())
                res = measure(fns, 4)
                kept = sum(int(mk.sum()) for mk in masks) / 4
                floor = max((kept * blk * blk * (0.5 + 2 / GROUP) + 2 * (m * k + m * n)) / bw / 1e3,
                            2 * m * kept * blk * blk / peak / 1e6)
                for r in res.values():
                    if "kernel_us" in r:
                        r["speedup_vs_cublas"] = res["cublas"]["kernel_us"] / r["kernel_us"]
                res["sparta_w4a16"]["sqnr_db_vs_fp16"] = sqnr
                print(f"{shape} {blk}x{blk} {sp}%: cuBLAS {res['cublas']['kernel_us']:.1f} us | w4a16 "
                      f"{res['sparta_w4a16'].get('kernel_us', float('nan')):.1f} us "
                      f"({res['sparta_w4a16'].get('speedup_vs_cublas', 0):.2f}x, SQNR {sqnr:.1f} dB) | fp16 "
                      f"{res.get('sparta_fp16', {}).get('kernel_us', float('nan')):.1f} us | floor {floor:.1f} us",
                      flush=True)
                rows.append({"shape": shape, "block": blk, "tile": tile, "sparsity": sp, "floor_us": floor,
                             "results": res})
    return rows


def main():
    bw, peak = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s, cuBLAS fp16 {peak:.0f} TFLOP/s; torch {torch.__version__}",
          flush=True)
    out = {"copy_GBps": bw, "cublas_peak_tflops": peak, "dense": dense_rows(bw, peak), "sparse": sparse_rows(bw, peak)}
    print(f"wrote {save('cuda_w4_gemm', out)}")


if __name__ == "__main__":
    main()
