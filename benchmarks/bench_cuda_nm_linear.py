"""sparta's 2:4 sparse linear (``mma.sp``) at Llama-7B's decode shapes against cuBLAS, cuSPARSELt and torch's 2:4.

    python benchmarks/bench_cuda_nm_linear.py --build [DIR]          # TVM + nvcc: kernels + manifest.json into DIR
    python benchmarks/bench_cuda_nm_linear.py [--dir DIR] [--out FILE] [--only NAME ...]   # the GPU (no TVM)

Shapes (N×K): 4096×4096, 11008×4096 and 4096×11008, bf16, no bias, a 2:4 mask keeping the 2 largest of each group
of 4 (magnitude pruning); M = 1, 4, 8 and 16 rows (the GEMV's range; 32 and 64 ran at 0.1-0.46x cuBLAS in the first run). A kernel depends
on the shape, the rows it serves (1, 4, 8, 16: one or two n8 MMAs a K tile) and its knobs, not on the mask: each is
built once — the first run's best per case, and a sweep of ``tiles`` (row tiles a CTA: X staged once for all) and
``prefetch`` (register double-buffered weight fragments) with ``warps`` / ``inflight`` / ``ksplit``.
The build keeps sm_90 cubins only, no CUDA source; ``manifest.json`` lists every kernel with its spec.

On the GPU each weight is made on the GPU from a seed and packed there once (``pack_nm``: the format depends on the
shape only), copied to rotate past the L2, and every kernel (sparta's and the peers') is checked against the masked
dense linear before timing (a wrong one is reported, not timed); then timed kernel-only (CUDA graphs of 40 calls,
``common.gpu_kernel_us``) beside cuBLAS (``F.linear`` on the masked dense weight), cuSPARSELt
(``torch._cslt_sparse_mm`` after ``torch._cslt_compress``) and ``to_sparse_semi_structured`` where they run.
``floor`` is the packed bytes (half the values and their metadata) at the measured copy bandwidth. Prints one table
per shape and M, fastest first, with the ratio to cuBLAS and the fraction of the floor reached; the JSON has every
row.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import build_folders, build_or_time, copy_bandwidth, gpu_kernel_us, save  # noqa: E402

OUT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda")
           ).parent / "cuda_nm_linear"
SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}
ROWS = {1: (1,), 4: (4,), 8: (4, 8), 16: (16,)}                             # the rows a build serves -> M timed on it
# the best kernel of each case in the first H200 run (benchmarks/results/nm_linear-h200-2026-11-28.json), timed
# again beside the new variants (rows 4: that run's M=4 best, built for 4 rows): shape -> rows -> (warps, inflight,
# ksplit)
BASELINES = {"4096x4096": {1: [(8, 8, 1)], 4: [(8, 8, 1)], 8: [(8, 8, 1)], 16: [(4, 8, 4)]},
             "11008x4096": {1: [(8, 8, 1)], 4: [(8, 8, 1)], 8: [(8, 8, 1)], 16: [(4, 8, 4)]},
             "4096x11008": {1: [(4, 16, 2)], 4: [(4, 16, 4)], 8: [(8, 8, 2), (4, 16, 4)], 16: [(4, 8, 8)]}}
# the new knobs: rows -> (tiles, warps, inflight, prefetch, ksplits). ``tiles`` row tiles a CTA: X (M x the
# range's K, staged in shared memory) is read from L2 once for 16 * tiles channels instead of 16 (at 16 rows X's
# bytes were 1.8x the weight's per CTA); ``prefetch``: the next batch's fragments load while this one multiplies
SWEEP = {
    1: [(1, 8, 8, True, (1, 2)), (2, 8, 8, False, (1, 2)), (2, 8, 8, True, (1, 2)), (2, 8, 16, False, (2,))],
    4: [(2, 8, 8, False, (1, 2)), (2, 8, 8, True, (1, 2))],      # 4 rows: half X's shared memory of a r8 build
    8: [(1, 8, 8, True, (1, 2)), (2, 8, 8, False, (1, 2, 4)), (2, 8, 8, True, (1, 2, 4)), (4, 8, 8, False, (2, 4)),
        (4, 8, 8, True, (2, 4)), (2, 16, 8, False, (1, 2)), (4, 16, 8, False, (2,))],
    16: [(2, 8, 8, False, (2, 4)), (2, 8, 8, True, (2, 4)), (4, 8, 8, False, (2, 4, 8)), (4, 8, 8, True, (2, 4, 8)),
         (4, 16, 8, False, (2, 4)), (4, 8, 16, False, (4,)), (8, 8, 8, False, (4, 8)), (8, 8, 8, True, (4, 8)),
         (8, 16, 8, False, (4, 8))],
}
ARCHS = ("sm_90",)
ROTATE_BYTES = 160e6


def kernel_name(shape: str, rows: int, warps: int, inflight: int, ksplit: int, tiles: int = 1,
                prefetch: bool = False) -> str:
    return (f"nm_{shape}_r{rows}_w{warps}i{inflight}k{ksplit}" + (f"t{tiles}" if tiles > 1 else "")
            + ("p" if prefetch else ""))


def kernels() -> dict:
    """Kernel name (its folder) -> spec: the first run's best per case and the sweep of ``tiles`` / ``prefetch``
    (invalid ones, X of too many rows for shared memory, left out, and those with idle warps or, prefetching, a
    single batch a warp)."""
    from sparta.templates.nm_linear.spec import NmLinearError, NmLinearSpec
    specs = {}
    for shape, (n, k) in SHAPES.items():
        for rows in ROWS:
            cands = [(1, w, i, False, ks) for w, i, ks in BASELINES[shape][rows]]
            cands += [(t, w, i, pf, ks) for t, w, i, pf, kss in SWEEP[rows] for ks in kss]
            for t, w, i, pf, ks in cands:
                name = kernel_name(shape, rows, w, i, ks, t, pf)
                try:
                    spec = NmLinearSpec(n, k, rows=rows, warps=w, inflight=i, ksplit=ks, tiles=t, prefetch=pf,
                                        name=name)
                except NmLinearError:
                    continue
                if spec.batches < spec.tile_warps or (pf and spec.batches < 2 * spec.tile_warps):
                    continue
                specs[name] = spec
    return specs


def build(folder: Path, jobs: int) -> None:
    from sparta.templates.nm_linear.kernel import nm_linear
    build_folders(nm_linear, kernels(), folder, jobs, ARCHS)



def weight_two_four(n: int, k: int, seed: int):
    """A bf16 weight and its 2:4 magnitude mask (the 2 largest of each group of 4), made on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
    top = w.float().abs().view(n, k // 4, 4).topk(2, dim=-1).indices
    mask = torch.zeros(n, k // 4, 4, dtype=torch.bool, device="cuda").scatter_(-1, top, True).view(n, k)
    return w, mask


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


def peers(w_masked: torch.Tensor, xs: list, want: torch.Tensor, sets: int) -> dict:
    """µs of cuBLAS, cuSPARSELt and torch's semi-structured linear on the masked weight (None where one cannot run
    or is wrong)."""
    dense = [w_masked] + [w_masked.clone() for _ in range(sets - 1)]
    out = {"cublas": gpu_kernel_us(lambda i: F.linear(xs[i % len(xs)], dense[i]), sets)}
    m = xs[0].shape[0]
    for name in ("cusparselt", "semi_structured"):
        try:
            if name == "cusparselt":
                comp = [torch._cslt_compress(w) for w in dense]
                xt = [x.t().contiguous() for x in xs]

                def fn(i, comp=comp, xt=xt):
                    return torch._cslt_sparse_mm(comp[i % len(comp)], xt[i % len(xt)]).t()
            else:
                from torch.sparse import to_sparse_semi_structured
                sp = [to_sparse_semi_structured(w) for w in dense]

                def fn(i, sp=sp):
                    return F.linear(xs[i % len(xs)], sp[i % len(sp)])
            got = fn(0)
            err = _rel_err(got[:m], want)
            if not err < 2e-2:
                raise RuntimeError(f"wrong: relative error {err:.3g}")
            out[name] = gpu_kernel_us(fn, sets)
        except Exception as exc:  # noqa: BLE001 - a peer torch cannot run here is reported, not fatal
            out[name] = None
            print(f"  {name} at M={m}: not run ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:100] if str(exc) else ''})", flush=True)
    return out


def bench_shape(shape: str, manifest: list, root: Path, bw: float, only, wrong: list) -> list[dict]:
    from sparta.runtime.cuda import CudaKernel
    from sparta.templates.nm_linear.runtime import NmLinearOp
    from sparta.templates.nm_linear.spec import NmLinearSpec, NmPacked, pack_nm
    n, k = SHAPES[shape]
    w, mask = weight_two_four(n, k, seed=n * 7 + k)
    w_masked = torch.where(mask, w, torch.zeros_like(w))
    t0 = time.perf_counter()
    packed = pack_nm(w, NmLinearSpec(n, k), mask)                         # on the GPU; the same for every build
    torch.cuda.synchronize()
    print(f"  packed {shape} in {time.perf_counter() - t0:.2f} s ({packed.nbytes() / 1e6:.1f} MB)", flush=True)
    copies = [packed] + [NmPacked(packed.values.clone(), packed.meta.clone())
                         for _ in range(max(2, math.ceil(ROTATE_BYTES / packed.nbytes())) - 1)]
    floor_us = packed.nbytes() / bw / 1e3
    rows_out = []
    for rows, ms in ROWS.items():
        for m in ms:
            g = torch.Generator(device="cuda").manual_seed(m)
            xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(len(copies))]
            want = xs[0].float() @ w_masked.float().t()
            us = peers(w_masked, xs, want, max(2, math.ceil(ROTATE_BYTES / (n * k * 2))))
            for entry in manifest:
                spec = NmLinearSpec(**entry["spec"])
                if (spec.n, spec.k) != (n, k) or spec.rows != rows or (only and entry["name"] not in only):
                    continue
                kernel = CudaKernel(root / entry["name"])
                ops = [NmLinearOp(root / entry["name"], spec, p, None, kernel=kernel) for p in copies]
                err = _rel_err(ops[0](xs[0]), want)
                if not err < 2e-2:                  # recorded, not timed; the sweep goes on
                    print(f"  WRONG: {entry['name']} at M={m}: relative error {err:.3g}", flush=True)
                    wrong.append({"shape": shape, "m": m, "kernel": entry["name"], "rel_err": err})
                    continue
                us[entry["name"]] = gpu_kernel_us(lambda i: ops[i % len(ops)](xs[i % len(xs)]), len(ops))
            for name, t in us.items():
                rows_out.append({"shape": shape, "n": n, "k": k, "m": m, "kernel": name,
                                 "us": None if t is None else round(t, 3),
                                 "over_cublas": None if t is None else round(us["cublas"] / t, 3),
                                 "of_floor": None if t is None else round(floor_us / t, 3),
                                 "floor_us": round(floor_us, 3)})
            table = sorted((r for r in rows_out if r["m"] == m and r["us"] is not None), key=lambda r: r["us"])
            print(f"{shape} M={m}: floor {floor_us:.2f} µs ({packed.nbytes() / 1e6:.1f} MB)", flush=True)
            for r in table[:12]:
                print(f"  {r['kernel']:<36} {r['us']:8.2f} µs  {r['over_cublas']:5.2f}x cuBLAS  {r['of_floor']:5.2f} "
                      "of floor", flush=True)
    return rows_out


def main():
    args = build_or_time(__doc__, OUT, build, lambda ap: ap.add_argument(
        "--only", nargs="*", help="kernel names to time (default: all in the manifest)"))
    if args is None:
        return
    root = Path(args.dir)
    manifest = json.loads((root / "manifest.json").read_text())
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    rows, wrong = [], []
    for shape in SHAPES:
        rows += bench_shape(shape, manifest, root, bw, set(args.only or ()), wrong)
    best = {}
    for r in rows:
        if r["kernel"].startswith("nm_") and r["us"] is not None:
            key = f"{r['shape']} M={r['m']}"
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = {"kernel": r["kernel"], "us": r["us"], "over_cublas": r["over_cublas"],
                             "of_floor": r["of_floor"]}
    print("best sparta variant per case (target: >= 1.6x cuBLAS at M = 1-16):")
    for key, b in best.items():
        print(f"  {key:<18} {b['kernel']:<36} {b['over_cublas']:5.2f}x cuBLAS  {b['of_floor']:5.2f} of floor")
    if wrong:
        print(f"{len(wrong)} kernel runs were WRONG (not timed): {sorted({w['kernel'] for w in wrong})}")
    payload = {"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": rows, "best": best, "wrong": wrong}
    print(f"wrote {save('nm_linear', payload)}")
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
