"""W8A8 on BERT-base FFN shapes (4096 tokens): sparta's int8 tensor-core kernel, dense and block-sparse,
against fp16 cuBLAS (``F.linear``) and ``torch._int_mm`` (cuBLASLt int8 → int32), in one process.

    python benchmarks/build_cuda_kernels.py          # here (TVM + nvcc): artifacts/cuda/*_i8_*
    python benchmarks/bench_cuda_w8a8.py             # on the GPU machine

Kernel-only times replay CUDA graphs over 4 input/weight sets (defeats L2); "eager" is host wall
time per call. sparta's rows time the GEMM on activations already quantised per token (the
epilogue applies both scales, bias and writes fp16); ``quant_sparta`` (sparta's one-pass kernel,
``templates/quant/``) and ``quant_torch`` time the standalone per-token quantisation a
model without a fused producer pays on top ("with quant" adds the faster one). ``*_q8`` rows are the same
tiles with the requantising epilogue (``out="int8"``: int8 codes of one static scale, what a W8A8 linear
reading this one takes, so neither the fp16 write nor the next quantiser pass is paid). ``_int_mm`` returns raw
int32 (no scales, no bias): it is the peer the issue names, and a lower bound on a cuBLAS W8A8.
Floors: bytes moved (int8 X and kept W, fp16 Y; int8 Y for ``_q8``) at the measured copy bandwidth, and the int8
dense tensor-core rate taken as twice the measured fp16 cuBLAS peak.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_cuda_bsr import SETS, ceilings, measure  # noqa: E402  (benchmarks/ is the script's folder)
from common import bench_mask, save  # noqa: E402
from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec
from sparta.templates.quant.runtime import RowQuantizer
from sparta.templates.bsr_linear.spec import reference_int8
from sparta.templates.quant.spec import quantize_rows

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
SHAPES = {"ffn1": (4096, 3072, 768), "ffn2": (4096, 768, 3072)}
# benchmarks/epilogue_probe.py: kernels without their epilogue / its arithmetic; "ab": an earlier build of a tile
# copied beside it as ab_<name> (an A/B of a template change in one process)
PROBES = ("noepi", "nomath", "ab")


def run(shape: str, m: int, n: int, k: int, sparsity: int, blk: int | None, bw: float, peak: float) -> dict:
    xs = [torch.randn(m, k, device="cuda").half() for _ in range(SETS)]
    xq = [quantize_rows(x) for x in xs]
    ws = [torch.randn(n, k, device="cuda").half() for _ in range(SETS)]
    b = torch.randn(n, device="cuda").half()
    ys = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(SETS)]
    y8 = [torch.empty(m, n, dtype=torch.int8, device="cuda") for _ in range(SETS)]
    tiles = "t" if blk is None else f"b{blk}_t"
    folders = sorted(ROOT.glob(f"{shape}_i8_{tiles}*"))
    folders += [f for probe in PROBES for f in sorted(ROOT.glob(f"{probe}_{shape}_i8_{tiles}*"))]
    if blk is None:
        masks = None
    else:
        masks = [bench_mask(-(-n // blk), -(-k // blk), 1 - sparsity / 100, f"{shape}-{blk}-{sparsity}-{i}")
                 for i in range(SETS)]
    fns = {"cublas_fp16": lambda i: F.linear(xs[i], ws[i], b)}
    wq8 = [quantize_rows(w)[0] for w in ws]
    fns["torch_int_mm"] = lambda i: torch._int_mm(xq[i][0], wq8[i].t())
    fns["quant_torch"] = lambda i: quantize_rows(xs[i])
    if (ROOT / f"q_{shape}").is_dir():
        quantizer = RowQuantizer(ROOT / f"q_{shape}")
        fns["quant_sparta"] = lambda i: quantizer(xs[i])
    errs = {}
    for f in folders:
        spec = load_spec(f)
        full = torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool)
        ref = reference_int8(*xq[0], *quantize_rows(ws[0]), None if masks is None else masks[0], b, "none",
                             spec.bn, spec.bk).float()
        q8 = spec.out == "int8"
        scale = float(ref.abs().max()) / 127 if q8 else None
        ops = [BsrLinearOp(f, spec, ws[i], full if masks is None else masks[i], b, out_scale=scale)
               for i in range(SETS)]
        outs = y8 if q8 else ys
        ops[0].int8(*xq[0], out=outs[0])
        probe = f.name.split("_", 1)[0]
        key = (f"probe_{probe}_" if probe in PROBES else "sparta_") + f.name.split("_i8_", 1)[1]
        if key.startswith("probe"):         # a kernel cut short by epilogue_probe.py: output not checked
            errs[key] = None
        elif q8:     # codes against the reference's: the largest difference, in codes
            codes = reference_int8(*xq[0], *quantize_rows(ws[0]), None if masks is None else masks[0], b, "none",
                                   spec.bn, spec.bk, scale)
            errs[key] = (outs[0].int() - codes.int()).abs().max().item()
        else:
            errs[key] = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
        fns[key] = (lambda ops, outs: lambda i: ops[i].int8(*xq[i], out=outs[i]))(ops, outs)
    res = measure(fns, SETS)
    kept = k * n if masks is None else sum(int(mk.sum()) for mk in masks) / SETS * blk * blk
    floor = max((m * k + kept + 2 * m * n) / bw / 1e3, 2 * m * kept / (2 * peak) / 1e6)
    floor_q8 = max((m * k + kept + m * n) / bw / 1e3, 2 * m * kept / (2 * peak) / 1e6)
    base = res["cublas_fp16"]["kernel_us"]
    for name, r in res.items():
        if "kernel_us" in r:
            r["vs_cublas_fp16"] = base / r["kernel_us"]
            r["tops"] = None if name.startswith("quant") else 2 * m * n * k / r["kernel_us"] / 1e6
        r["max_code_diff" if name.endswith("_q8") else "max_rel_err"] = errs.get(name)
    timed = {k_: v["kernel_us"] for k_, v in res.items() if k_.startswith("sparta") and "kernel_us" in v}
    best = min(((t, k_) for k_, t in timed.items() if not k_.endswith("_q8")), default=None)
    best_q8 = min(((t, k_) for k_, t in timed.items() if k_.endswith("_q8")), default=None)
    label = "dense" if blk is None else f"{blk}x{blk} {sparsity}%"
    quant = min(v["kernel_us"] for k_, v in res.items() if k_.startswith("quant") and "kernel_us" in v)
    fp16_out = (f"{best[1]} {best[0]:.1f} us x{base / best[0]:.2f} (with quant x{base / (best[0] + quant):.2f})"
                if best else "no fp16-out kernel")
    int8_out = (f" || int8 out: {best_q8[1]} {best_q8[0]:.1f} us x{base / best_q8[0]:.2f} | floor x{base / floor_q8:.2f}"
                if best_q8 else "")
    print(f"{shape} W8A8 {label}: fp16 cuBLAS {base:.1f} us | _int_mm x{res['torch_int_mm']['vs_cublas_fp16']:.2f} | "
          f"{fp16_out} | floor x{base / floor:.2f}{int8_out}", flush=True)
    return {"shape": shape, "m": m, "n": n, "k": k, "block": blk, "sparsity": sparsity if blk else 0,
            "floor_us": floor, "floor_speedup": base / floor, "floor_q8_us": floor_q8,
            "floor_q8_speedup": base / floor_q8, "results": res}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sparsities", type=int, nargs="*", default=[90])
    ap.add_argument("--blocks", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--no-dense", action="store_true")
    args = ap.parse_args()
    bw, peak = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s, cuBLAS fp16 8192^3 {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for shape, (m, n, k) in SHAPES.items():
        if not args.no_dense:
            rows.append(run(shape, m, n, k, 0, None, bw, peak))
        for blk in args.blocks:
            for sp in args.sparsities:
                rows.append(run(shape, m, n, k, sp, blk, bw, peak))
    print(f"wrote {save('cuda_w8a8', {'copy_GBps': bw, 'cublas_peak_tflops': peak, 'rows': rows})}")


if __name__ == "__main__":
    main()
