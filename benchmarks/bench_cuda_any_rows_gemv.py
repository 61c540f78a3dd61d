"""The low-bit GEMVs a default (any rows) compile runs against the ones a static compile of each row count runs.

    python benchmarks/bench_cuda_any_rows_gemv.py --build     # machine with TVM + nvcc (no GPU needed)
    python benchmarks/bench_cuda_any_rows_gemv.py             # GPU machine (torch + cuda-bindings, no TVM)

For LLaMA-7B's 11008x4096 and 4096x4096 linears, W4A16 (group 128, zero points: what calibration fits) and W8A8
(per-channel weights, per-token activations), at 1, 2, 4, 8, 12 and 16 rows: the kernel selection picks for a graph
of that many rows (``dynamic=False``: the GEMV built for M) and for a graph of any rows (the default: the GEMV of
the bucket holding M, built for any M), the tilings taken from ``codegen/select_cuda.py`` as compile does; the any-M
W8A8 GEMVs read the dense int8 tile's packed blocks and table (one packed weight per linear). Kernel-only
time (CUDA graphs of 40 calls rotating weight sets past the L2); the HBM floor is the weight (+ scale) bytes over the
measured copy bandwidth (read + write), as in ``bench_cuda_w4a16.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_kernel_us, save  # noqa: E402

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
OUT = ROOT / "any_rows_gemv"
SHAPES = {"11008x4096": (11008, 4096), "4096x4096": (4096, 4096)}
ROWS = (1, 2, 4, 8, 12, 16)
GROUP, ROTATE_BYTES = 128, 120e6


def specs() -> dict:
    """name -> spec: per shape, the static GEMV of each row count and the any-M GEMVs of a default compile."""
    from sparta.codegen.select_cuda import GemmSite
    from sparta.templates.w4a16_gemv.select import gemv_tiling, w4a16_few_rows
    from sparta.templates.w8a8_gemv.select import w8a8_few_rows, w8a8_gemv_tiling
    from sparta.target import load_target
    from sparta.templates.w4a16_gemv.spec import W4A16Spec
    from sparta.templates.w8a8_gemv.spec import W8A8GemvSpec
    cuda = load_target("cuda")
    out = {}
    for shape, (n, k) in SHAPES.items():
        site = GemmSite(None, None, 1, n, k, "W4A16", True, 32, "none", "none", False, torch.zeros(0, 0), GROUP, "",
                        any_rows=True)
        for m in ROWS:
            out[f"w4_{shape}_m{m}"] = W4A16Spec(m, n, k, group=GROUP, sym=False, **gemv_tiling(m, n, k, GROUP))
            out[f"w8_{shape}_m{m}"] = W8A8GemvSpec(m, n, k, **w8a8_gemv_tiling(m, n, k, cuda))
        for top, _, t in w4a16_few_rows(site, cuda):
            t = dict(t)
            t.pop("group")
            out[f"w4_{shape}_any{top}"] = W4A16Spec(0, n, k, group=GROUP, sym=False, rows=max(top, 8), **t)
        tile = int8_tile(n, cuda)
        for top, _, t in w8a8_few_rows(site, cuda):
            out[f"w8_{shape}_any{top}"] = W8A8GemvSpec(0, n, k, rows=max(top, 8), **{**t, "sparse": False},
                                                       bn=tile["bn"], bk=tile["bk"])
    return {name: type(s)(**{**s.__dict__, "name": name}) for name, s in out.items()}


def int8_tile(n: int, target) -> dict:
    """The mma.sync tiling of a dense W8A8 linear of any rows (its blocks are what the any-M GEMVs read)."""
    from sparta.templates.bsr_linear.select import int8_dense_tiles
    return int8_dense_tiles(1, n, target)[0]


def build(jobs: int) -> None:
    from sparta.codegen.cuda_build import build_folders
    build_folders(specs(), OUT, jobs, log=lambda line: print(line, flush=True))


def _kernel(name):
    from sparta.runtime.cuda import CudaKernel
    from sparta.templates.w4a16_gemv.spec import W4A16Spec
    from sparta.templates.w8a8_gemv.spec import W8A8GemvSpec
    data = json.loads((OUT / name / "spec.json").read_text())
    spec = (W4A16Spec if name.startswith("w4") else W8A8GemvSpec)(**data)
    return spec, CudaKernel(OUT / name)


def _bucket(names: list[str], shape: str, fam: str, m: int) -> str:
    tops = sorted(int(n.rsplit("any", 1)[1]) for n in names if n.startswith(f"{fam}_{shape}_any"))
    return f"{fam}_{shape}_any{next(t for t in tops if m <= t)}"


def bench_w4(shape, n, k, names, bw) -> list[dict]:
    from sparta.templates.w4a16_gemv.spec import codes_of, pack_codes, quantize, reference, split_buffers
    torch.manual_seed(n + k)
    w = torch.randn(n, k, device="cuda") * 0.05
    scale, zero = quantize(w, GROUP, sym=False)
    codes = codes_of(w, scale, zero, GROUP)
    wbytes, sbytes = n * k // 2, 2 * n * (k // GROUP)
    sets = max(2, math.ceil(ROTATE_BYTES / (wbytes + sbytes + n * (k // GROUP))))
    floor = (wbytes + sbytes) / bw / 1e3
    probe, _ = _kernel(f"w4_{shape}_m1")
    weights = []
    for _ in range(sets):
        wq, s, z = pack_codes(codes, scale, zero, probe)
        weights.append({"Wq": wq, "S": s, "Z": z})
    rows = []
    for m in ROWS:
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(sets)]
        ys = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(sets)]
        row = {"family": "W4A16", "shape": shape, "m": m, "floor_us": floor}
        for key, name in (("static", f"w4_{shape}_m{m}"), ("any_rows", _bucket(names, shape, "w4", m))):
            spec, kern = _kernel(name)
            prep = kern.prepare(X=xs[0], Y=ys[0], **weights[0], **split_buffers(spec, "cuda"))
            torch.cuda.synchronize()
            ref = reference(xs[0], weights[0]["Wq"], weights[0]["S"], weights[0]["Z"], None, spec)
            err = ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()
            us = gpu_kernel_us(lambda i: prep.launch(X=xs[i], Y=ys[i], **weights[i]), sets)
            row[key] = {"kernel": name, "kernel_us": us, "x_floor": us / floor, "max_rel_err": err}
        row["any_vs_static"] = row["any_rows"]["kernel_us"] / row["static"]["kernel_us"]
        rows.append(row)
        _print(row)
    return rows


def bench_w8(shape, n, k, names, bw) -> list[dict]:
    from sparta.templates.quant.spec import quantize_rows
    from sparta.templates.w8a8_gemv.spec import pack_weight, reference
    torch.manual_seed(n + k + 1)
    w = torch.randn(n, k, device="cuda") * (torch.rand(n, 1, device="cuda") + 0.01)
    wq, ws = quantize_rows(w)
    sets = max(2, math.ceil(ROTATE_BYTES / (n * k)))
    floor = (n * k + 4 * n) / bw / 1e3
    from sparta.target import load_target
    from sparta.templates.bsr_linear.packing import pack_weight as pack_blocks
    from sparta.templates.bsr_linear.spec import BsrSpec
    probe, _ = _kernel(f"w8_{shape}_m1")
    tile = BsrSpec(0, n, k, dtype="int8", **int8_tile(n, load_target("cuda")))
    own = [pack_weight(probe, wq)[0].clone() for _ in range(sets)]
    blocks = [pack_blocks(wq, tile, torch.ones(tile.row_blocks, tile.k_blocks, dtype=torch.bool)) for _ in range(sets)]
    rows = []
    for m in ROWS:
        xq = [quantize_rows(torch.randn(m, k, device="cuda")) for _ in range(sets)]
        ys = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(sets)]
        row = {"family": "W8A8", "shape": shape, "m": m, "floor_us": floor}
        for key, name in (("static", f"w8_{shape}_m{m}"), ("any_rows", _bucket(names, shape, "w8", m))):
            spec, kern = _kernel(name)
            packed = [b[0] for b in blocks] if spec.blocks else own
            tab = {"Tab": blocks[0][1]} if spec.blocks else {}
            args = dict(XQ=xq[0][0].view(torch.int32), XS=xq[0][1], WQ=packed[0].view(torch.int32), WS=ws, Y=ys[0], **tab)
            prep = kern.prepare(("XQ", "XS", "Y"), **args)
            torch.cuda.synchronize()
            ref = reference(*xq[0], wq, ws)
            err = ((ys[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us = gpu_kernel_us(lambda i, packed=packed: prep.launch(XQ=xq[i][0].view(torch.int32), XS=xq[i][1],
                                                                     WQ=packed[i].view(torch.int32), Y=ys[i]), sets)
            row[key] = {"kernel": name, "kernel_us": us, "x_floor": us / floor, "max_rel_err": err}
        row["any_vs_static"] = row["any_rows"]["kernel_us"] / row["static"]["kernel_us"]
        rows.append(row)
        _print(row)
    return rows


def _print(row):
    s, a = row["static"], row["any_rows"]
    print(f"{row['family']} {row['shape']} M={row['m']}: static {s['kernel_us']:.2f} us ({s['x_floor']:.2f}x floor) | "
          f"any rows {a['kernel_us']:.2f} us ({a['x_floor']:.2f}x floor, {a['kernel']}) | any/static "
          f"{row['any_vs_static']:.3f} | err {a['max_rel_err']:.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="build the kernels (TVM + nvcc) instead of timing them")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    if args.build:
        build(args.jobs)
        return
    from bench_cuda_w4a16 import copy_bandwidth
    bw = copy_bandwidth()
    names = sorted(p.name for p in OUT.iterdir() if (p / "spec.json").is_file())
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    rows = []
    for shape, (n, k) in SHAPES.items():
        rows += bench_w4(shape, n, k, names, bw) + bench_w8(shape, n, k, names, bw)
    worst = max(r["any_vs_static"] for r in rows)
    print(f"worst any-rows / static kernel time: {worst:.3f}")
    path = save("any_rows_gemv", {"copy_GBps": bw, "rows": rows, "worst_any_vs_static": worst})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
