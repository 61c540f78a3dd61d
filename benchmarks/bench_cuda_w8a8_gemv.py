"""sparta's W8A8 GEMV (decode) vs the tile kernels compile built before it, cuBLASLt int8 and fp16 cuBLAS.

    python benchmarks/build_cuda_kernels.py --only $(python benchmarks/bench_cuda_w8a8_gemv.py --list)   # TVM + nvcc
    python benchmarks/bench_cuda_w8a8_gemv.py [--batches 1 16]                                           # the GPU

Shapes N×K = 4096×4096, 11008×4096, 4096×11008 at 1, 4, 8 and 16 rows; the dp4a kernel and the tensor-core one
(``mma``: weights in fragment order); int8 weights per channel, int8 activations per token (sparta's W8A8 scheme: the codes a LayerNorm kernel or the row quantiser hands a W8A8 linear), fp16 out.
Peers in the same process: sparta's int8 tile kernels (``bsr_linear``, mma.sync and wgmma, the tiles
``int8_dense_tiles`` picks: what ``compile`` ran such ops on before), ``torch._int_mm`` (cuBLASLt int8 → int32,
no scales; it needs more than 16 rows, so X is padded to 32), fp16 cuBLAS ``F.linear``. Kernel-only time: CUDA
graphs of 40 calls rotating weight sets beyond the L2 (120 MB); the ``_pdl`` tilings chain their launches (each
overlaps the previous one's tail, as consecutive GEMVs in a model). Floor = (int8 weights + fp32 scales) /
measured copy bandwidth. "with quantiser" adds sparta's per-token quantiser of X (``templates/quant/``).
``--sparsity 90``: 90% of the 32×32 blocks pruned (rows 1 and 16): the block-sparse GEMV (kept 16×32 chunks only)
against the dense GEMV on the same weights and the W8A8 block tile kernel ``compile`` used for such ops; its floor
counts the kept weight bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_mask, gpu_kernel_us, save  # noqa: E402

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
ROTATE_BYTES = 120e6


def bench_shape(shape: str, n: int, k: int, m: int, bw: float, sparsity: int = 0) -> dict:
    from bench_cuda_w4a16 import sqnr_db

    from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec
    from sparta.templates.quant.runtime import RowQuantizer
    from sparta.templates.w8a8_gemv.runtime import W8A8GemvOp
    from sparta.templates.quant.spec import quantize_rows
    from sparta.templates.w8a8_gemv.spec import W8A8GemvSpec, pack_weight, reference

    torch.manual_seed(n + k + m)
    w = torch.randn(n, k, device="cuda") * 0.05
    mask = None
    if sparsity:      # whole 32x32 blocks pruned, as a plan's block cover leaves them
        mask = bench_mask(n // 32, k // 32, 1 - sparsity / 100, f"w8a8-gemv-{shape}-{sparsity}").cuda()
        w = w * mask.repeat_interleave(32, 0).repeat_interleave(32, 1)
    wq, ws = quantize_rows(w)
    kept = n * k if mask is None else int(mask.sum()) * 32 * 32
    sets = max(2, math.ceil(ROTATE_BYTES / kept))
    wqs = [wq.clone() for _ in range(sets)]
    xs = [torch.randn(m, k, device="cuda").half() for _ in range(sets)]
    xq = [quantize_rows(x) for x in xs]
    ys = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(sets)]
    ref = reference(*xq[0], wq, ws)
    exact = F.linear(xs[0].float(), w)
    res, floor_us = {}, (kept + 4 * n) / bw / 1e3
    pattern = f"w8s_{shape}_m{m}_*" if sparsity else f"w8g_{shape}_m{m}_*"     # sparse: the dense GEMV beside
    for folder in sorted(ROOT.glob(pattern)) + (sorted(ROOT.glob(f"w8g_{shape}_m{m}_mma_w*g4")) if sparsity else []):
        key = f"sparta_gemv_{folder.name.split('_', 3)[-1]}"
        try:
            spec = W8A8GemvSpec(**json.loads((folder / "spec.json").read_text()))
            packed = [pack_weight(spec, wqs[i]) for i in range(sets)]
            ops = [W8A8GemvOp(folder, spec, p[0], ws, table=p[1]) for p in packed]
            ops[0](*xq[0], out=ys[0])
            torch.cuda.synchronize()
            r = {"max_rel_err": ((ys[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
                 "sqnr_db_vs_fp32": sqnr_db(ys[0], exact)}
            r["kernel_us"] = gpu_kernel_us(lambda i: ops[i](*xq[i], out=ys[i]), sets)
            res[key] = r
        except Exception as exc:  # noqa: BLE001 - report, keep going
            res[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    for folder in sorted(ROOT.glob(f"w8b_{shape}_m{m}_*" if sparsity else f"w8t_{shape}_m{m}_*")):
        key = f"sparta_tile_{folder.name.rsplit('_', 1)[-1]}"
        try:
            spec = load_spec(folder)
            blocks = torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool) if mask is None else mask.cpu()
            ops = [BsrLinearOp(folder, spec, w, blocks) for _ in range(min(sets, 3))]
            ops[0].int8(*xq[0], out=ys[0])
            torch.cuda.synchronize()
            r = {"max_rel_err": ((ys[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item()}
            r["kernel_us"] = gpu_kernel_us(lambda i: ops[i % len(ops)].int8(*xq[i], out=ys[i]), sets)
            res[key] = r
        except Exception as exc:  # noqa: BLE001
            res[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    quant = ROOT / f"w8q_{m}x{k}"
    if quant.is_dir():
        q = RowQuantizer(quant)
        res["quantiser"] = {"kernel_us": gpu_kernel_us(lambda i: q(xs[i]), sets)}
    pad = [torch.zeros(32, k, dtype=torch.int8, device="cuda") for _ in range(sets)]
    for i in range(sets):
        pad[i][:m] = xq[i][0]
    res["torch_int_mm_pad32"] = {"kernel_us": gpu_kernel_us(lambda i: torch._int_mm(pad[i], wqs[i].t()), sets)}
    wf = [w.half() for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
    res["cublas_fp16"] = {"kernel_us": gpu_kernel_us(lambda i: F.linear(xs[i % sets], wf[i]), len(wf))}
    for v in res.values():
        if "kernel_us" in v:
            v["x_floor"] = v["kernel_us"] / floor_us
    gemvs = [(v["kernel_us"], kk) for kk, v in res.items() if kk.startswith("sparta_gemv") and "kernel_us" in v]
    tiles = [(v["kernel_us"], kk) for kk, v in res.items() if kk.startswith("sparta_tile") and "kernel_us" in v]
    best, tile = min(gemvs), min(tiles, default=None)
    cub, imm = res["cublas_fp16"]["kernel_us"], res["torch_int_mm_pad32"]["kernel_us"]
    qus = res.get("quantiser", {}).get("kernel_us")
    print(f"{shape}{f' {sparsity}%' if sparsity else ''} m={m}: floor {floor_us:.2f} us | best GEMV {best[1]} {best[0]:.2f} us ({best[0] / floor_us:.2f}x "
          f"floor, err {res[best[1]]['max_rel_err']:.1e}) | tile kernel "
          f"{f'{tile[0]:.2f} us ({tile[0] / best[0]:.1f}x slower)' if tile else '-'} | _int_mm(pad 32) {imm:.2f} us | "
          f"cuBLAS fp16 {cub:.2f} us ({cub / best[0]:.2f}x){f' | quantiser {qus:.2f} us' if qus else ''}", flush=True)
    print("   " + " ".join(f"{kk}={v['kernel_us']:.2f}" for kk, v in res.items() if "kernel_us" in v), flush=True)
    return {"shape": shape, "n": n, "k": k, "m": m, "sparsity": sparsity, "floor_us": floor_us, "sets": sets,
            "best_gemv": best[1], "results": res}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="rows of X (default: 1 4 8 16)")
    ap.add_argument("--list", action="store_true", help="print the kernel names to build and exit")
    ap.add_argument("--sparsity", type=int, default=0, help="prune this %% of 32x32 blocks: the block-sparse GEMV "
                    "against the dense one on the pruned weights and the W8A8 block tile (rows 1 and 16)")
    args = ap.parse_args()
    from build_cuda_kernels import W8G_BATCHES, W8G_SHAPES, w8a8_gemv_bench_kernels
    if args.list:
        print(" ".join(w8a8_gemv_bench_kernels()))
        return
    from bench_cuda_w4a16 import copy_bandwidth
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    batches = args.batches or ((1, 16) if args.sparsity else W8G_BATCHES)
    rows = [bench_shape(shape, n, k, m, bw, args.sparsity) for shape, (n, k) in W8G_SHAPES.items() for m in batches]
    print(f"wrote {save('w8a8_gemv' + (f'_sparse{args.sparsity}' if args.sparsity else ''), {'copy_GBps': bw, 'rows': rows})}")


if __name__ == "__main__":
    main()
