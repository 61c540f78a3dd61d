"""sparta's W4A16 GEMV/small-batch kernel vs torch's tinygemm int4 kernel and fp16 cuBLAS.

    python benchmarks/build_w4a16_kernels.py       # machine with TVM + nvcc (no GPU needed)
    python benchmarks/bench_cuda_w4a16.py [--batches 16]   # GPU machine (torch + cuda-bindings, no TVM)

Shapes N×K = 4096×4096, 11008×4096, 4096×11008 at batch 1 and 16; int4 weights, group 128, with zero
points (sparta: asymmetric uint8 zeros; tinygemm: its scale-and-zero pairs). Kernel-only time: CUDA
graphs of 40 calls rotating weight sets whose total exceeds 2.4× the 50 MB L2. The HBM floor is
(int4 weight bytes + fp16 scale bytes) / measured device-to-device copy bandwidth (read + write); beside
it, the time of a plain one-pass read of the same bytes (``read_probe.py``): what any kernel can reach.
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
from common import copy_bandwidth, gpu_kernel_us, save  # noqa: E402

from sparta.runtime.cuda import CudaKernel  # noqa: E402
from sparta.templates.w4a16_gemv.spec import (W4A16Spec, codes_of, pack_codes, quantize, reference,  # noqa: E402
                                              split_buffers)

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
W4 = ROOT / "w4a16"
SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}
GROUP, ROTATE_BYTES = 128, 120e6



def sqnr_db(y, ref) -> float:
    return 10 * math.log10(ref.float().pow(2).sum().item() / (y.float() - ref.float()).pow(2).sum().clamp_min(1e-30).item())


def tinygemm(codes, scale, zero, xs, sets):
    """``torch._weight_int4pack_mm`` (inner k tiles 8): fn(i) and its result on set 0; tries fp16 then bf16."""
    w_uint8 = (codes[:, ::2].to(torch.int32) << 4 | codes[:, 1::2].to(torch.int32)).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(w_uint8, 8)
    last = None
    for dtype in (torch.float16, torch.bfloat16):
        try:
            # tinygemm dequantises (q - 8) * scale + zero_f: our (q - z) * scale has zero_f = (8 - z) * scale
            zf = (8 - zero.float()) * scale.float()
            sz = torch.stack([scale.float(), zf], -1).transpose(0, 1).contiguous().to(dtype)
            ws = [packed.clone() for _ in range(sets)]
            xd = [x.to(dtype) for x in xs]
            y = torch._weight_int4pack_mm(xd[0], ws[0], GROUP, sz)
            torch.cuda.synchronize()
            return (lambda i: torch._weight_int4pack_mm(xd[i], ws[i], GROUP, sz)), y, str(dtype).split(".")[-1]
        except Exception as exc:  # noqa: BLE001 - try the next activation dtype
            last = exc
    raise RuntimeError(f"tinygemm unavailable: {type(last).__name__}: {str(last)[:200]}")


def bench_shape(shape, n, k, m, bw):
    torch.manual_seed(n + k + m)
    w = torch.randn(n, k, device="cuda") * 0.05
    scale, zero = quantize(w, GROUP, sym=False)
    codes = codes_of(w, scale, zero, GROUP)
    wbytes, sbytes, zbytes = n * k // 2, 2 * n * (k // GROUP), n * (k // GROUP)
    sets = max(2, math.ceil(ROTATE_BYTES / (wbytes + sbytes + zbytes)))
    xs = [torch.randn(m, k, device="cuda").half() for _ in range(sets)]
    ys = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(sets)]
    res, floor_us = {}, (wbytes + sbytes) / bw / 1e3
    folders = sorted(W4.glob(f"b_{shape}_m{m}_*"))
    packed, refs = {}, {}                    # per zero-point mode: rotated (Wq, S, Z) sets; the fp32 reference
    for folder in folders:
        spec = W4A16Spec(**json.loads((folder / "spec.json").read_text()))
        if spec.sym not in packed:
            sc, zr = (quantize(w, GROUP, sym=True)[0], None) if spec.sym else (scale, zero)
            wq, s, z = pack_codes(codes if zr is not None else codes_of(w, sc, None, GROUP), sc, zr, spec)
            packed[spec.sym] = [{"Wq": wq.clone(), "S": s.clone(), **({} if z is None else {"Z": z.clone()})}
                                for _ in range(sets)]
            refs[spec.sym] = reference(xs[0], wq, s, z, None, spec)
        ws, key = packed[spec.sym], f"sparta_{folder.name.split('_', 3)[-1]}"
        try:
            kern = CudaKernel(folder)
            prep = kern.prepare(X=xs[0], Y=ys[0], **ws[0], **split_buffers(spec, "cuda"))
            torch.cuda.synchronize()
            r = {"sqnr_db": sqnr_db(ys[0], refs[spec.sym]), "sym": spec.sym}
            r["kernel_us"] = gpu_kernel_us(lambda i: prep.launch(X=xs[i], Y=ys[i], **ws[i]), sets)
            res[key] = r
        except Exception as exc:  # noqa: BLE001 - report, keep going
            res[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    ref = refs.get(False)
    try:
        fn, y, dt = tinygemm(codes, scale, zero, xs, sets)
        res["tinygemm"] = {"dtype": dt, "kernel_us": gpu_kernel_us(fn, sets),
                           "sqnr_db": sqnr_db(y, ref) if ref is not None else None}
    except Exception as exc:  # noqa: BLE001
        res["tinygemm"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    wf = [w.half() for _ in range(max(2, math.ceil(ROTATE_BYTES / (2 * n * k))))]
    res["cublas_fp16"] = {"kernel_us": gpu_kernel_us(lambda i: F.linear(xs[i % sets], wf[i]), len(wf))}
    timed = [(v["kernel_us"], kk) for kk, v in res.items() if kk.startswith("sparta") and "kernel_us" in v]
    best = min(t for t in timed if not res[t[1]]["sym"])                 # with zero points, like tinygemm
    best_sym = min((t for t in timed if res[t[1]]["sym"]), default=None)   # symmetric: no zero points to read
    read_us = read_probe_us(shape, wbytes + sbytes + zbytes, sets)
    for v in res.values():
        if "kernel_us" in v:
            v["x_floor"] = v["kernel_us"] / floor_us
            v["eff_GBps"] = (wbytes + sbytes) / v["kernel_us"] / 1e3
    row = {"shape": shape, "n": n, "k": k, "m": m, "group": GROUP, "weight_bytes": wbytes, "scale_bytes": sbytes,
           "zero_bytes": zbytes, "sets": sets, "floor_us": floor_us, "read_probe_us": read_us,
           "best_sparta": best[1], "best_sparta_sym": best_sym and best_sym[1], "results": res}
    tg = res["tinygemm"].get("kernel_us")
    row["best_vs_tinygemm"] = tg / best[0] if tg else None
    row["best_vs_cublas"] = res["cublas_fp16"]["kernel_us"] / best[0]
    print(f"{shape} m={m}: floor {floor_us:.2f} us | best sparta {best[1]} {best[0]:.2f} us "
          f"({best[0] / floor_us:.2f}x floor, SQNR {res[best[1]]['sqnr_db']:.1f} dB) | tinygemm "
          f"{f'{tg:.2f} us ({tg / floor_us:.2f}x floor)' if tg else res['tinygemm'].get('error')} | cuBLAS fp16 "
          f"{res['cublas_fp16']['kernel_us']:.2f} us | plain read of its bytes "
          f"{f'{read_us:.2f} us ({read_us / floor_us:.2f}x floor)' if read_us else '-'}"
          f"{f' | symmetric {best_sym[1]} {best_sym[0]:.2f} us ({best_sym[0] / floor_us:.2f}x floor)' if best_sym else ''}",
          flush=True)
    print("   " + " ".join(f"{kk}={v['kernel_us']:.2f}" for kk, v in res.items() if "kernel_us" in v), flush=True)
    return row


def read_probe_us(shape, nbytes, sets) -> float | None:
    """Fastest of the ``read_probe`` kernels (``read_probe.py``) reading ``nbytes`` once, rotated like the weights."""
    best = None
    for folder in sorted(ROOT.glob(f"w4a16/read_{shape}_*")):
        kern = CudaKernel(folder)
        words = json.loads((folder / "spec.json").read_text())["words"]
        bufs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (words, 4), dtype=torch.int32, device="cuda") for _ in range(sets)]
        out = torch.zeros(1, dtype=torch.int32, device="cuda")
        prep = kern.prepare(P=bufs[0], O=out)
        us = gpu_kernel_us(lambda i: prep.launch(P=bufs[i], O=out), sets)
        best = us if best is None else min(best, us)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="rows of X (default: 1 16)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    rows = [bench_shape(shape, n, k, m, bw) for shape, (n, k) in SHAPES.items() for m in args.batches]
    path = save("w4a16", {"copy_GBps": bw, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
