"""sparta's block-sparse 16-bit GEMV at a Llama-2-7B decoder's shapes: a sweep of its parallelism knobs.

    python benchmarks/bench_cuda_bsr_gemv_7b.py --build             # TVM + nvcc: kernels into artifacts/cuda/g7_*/
    python benchmarks/bench_cuda_bsr_gemv_7b.py [--out g7.json]     # the GPU: torch and sparta's runtime only
    ... --rows 8 16 [--build]                                       # builds for 8 and 16 rows, run at M = 8, 16
    ... --tiles [--build]                                           # the tile kernel at M = 8, 16 (batched decode)

The decode-step linears of Llama-2-7B (bf16, no bias, 32×32 blocks, 90% of them pruned, seeded): ``o`` 4096×4096,
``qkv`` 12288×4096 (stacked), ``down`` 4096×11008, ``gated`` gate/up 2×11008×4096 (SiLU-gated: act(gate) · up, one
GEMV over the gated table). Each shape's GEMV (``templates/bsr_linear/gemv.py``, every variant a programmatic
dependent launch) over rows ∈ {1, 4} (the most rows a build takes; ``--rows``: others, e.g. 8 and 16 for a batch of
16 sequences, where loads ∈ {1, 2} and inflight 2 only: more would spill), warps ∈ {4, 8, 16}, loads ∈ {1, 2, 4} (16-byte
loads per lane per block: the rows a CTA owns, ``BsrGemvSpec.unit_rows``) and inflight ∈ {2, 4} (blocks a warp loads
before it multiplies), less the redundant: inflight 4 only where a block row keeps more than two blocks a warp on
average, and not where four blocks' registers spill at 16 warps of 4 rows. Beside them ``sel``: what kernel selection
builds now (``fp16_gemv_tiling``: 4 rows, its warps, the default loads and inflight).

On the GPU each variant runs at M = each of ``--rows`` it holds: checked against the torch reference
(``torch.testing.assert_close``, bf16 tolerances; a failure is recorded and the sweep goes on), then timed
kernel-only (CUDA graphs of 40 calls rotating weight sets beyond the L2). Floor = kept bf16 blocks / measured copy
bandwidth. Prints a table per shape and M sorted by time; the JSON has every row and the best variant per shape and M.
``--tiles``: the one-tile ``mma.sync`` kernel a plan runs for 5–128 rows (``BsrSpec(m=0)``, bf16, no bias, SiLU-gated
for ``gated``; prefix ``g7t_``) at M = 8 and 16, over its M tile (16 or 32 rows), warps along M and N, ``stages`` of
``cp.async`` in flight (4 is selection's; at 16 rows ``down`` and ``o`` have 128 block rows for 132 SMs, so their
bytes in flight are what the stages hold), checked against the torch reference first like the GEMVs.

The build keeps sm_90 cubins only (the H200) and no CUDA source (``kernel.cu``; ``cuda_source`` on the spec rebuilds
it), so the folders stay small.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_mask, copy_bandwidth, gpu_kernel_us, save  # noqa: E402

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
PREFIX = "g7_"
SHAPES = {"o": (4096, 4096, False), "qkv": (12288, 4096, False), "down": (4096, 11008, False),
          "gated": (11008, 4096, True)}          # N (the output; gated: of each half), K, gated
DENSITY = 0.10                  # blocks kept
BLOCK = 32
ROWS, WARPS, LOADS, INFLIGHT = (1, 4), (4, 8, 16), (1, 2, 4), (2, 4)
ARCHS = ("sm_90",)
ROTATE_BYTES = 120e6
DTYPE = "bfloat16"
TILE = dict(bn=BLOCK, bk=BLOCK)


TILE_PREFIX = "g7t_"
TILES = [dict(tm=16, warps_m=1, warps_n=1), dict(tm=16, warps_m=1, warps_n=2), dict(tm=32, warps_m=1, warps_n=1),
         dict(tm=32, warps_m=2, warps_n=1)]
STAGES = (4, 6, 8, 12)
TILE_ROWS = (8, 16)


def act_of(shape: str) -> str:
    return "silu" if SHAPES[shape][2] else "none"


def mask_of(shape: str) -> torch.Tensor:
    """The kept blocks of the packed weight (gated: the gate's block rows, then the up's)."""
    n, k, gate = SHAPES[shape]
    return bench_mask((2 if gate else 1) * n // BLOCK, k // BLOCK, DENSITY, f"bsr-gemv-7b-{shape}")


def slot_blocks(shape: str) -> float:
    """Kept blocks a CTA's block row (gated: gate and up rows) holds on average."""
    _, k, gate = SHAPES[shape]
    return DENSITY * (k // BLOCK) * (2 if gate else 1)


def variants(shape: str, build_rows=ROWS) -> list[dict]:
    """The sweep's knob settings for ``shape`` (see the module docstring for what is left out and why)."""
    out = []
    for rows in build_rows:
        for warps in WARPS:
            for loads in LOADS if rows <= 4 else (1, 2):
                for inflight in INFLIGHT if rows <= 4 else (2,):
                    if inflight == 4 and slot_blocks(shape) <= 2 * warps:
                        continue        # at most two blocks a warp: the same loads as inflight 2, more registers
                    if inflight == 4 and rows == 4 and warps == 16 and loads >= 2:
                        continue        # over the 128 registers a thread of 512 may hold: spills
                    out.append(dict(rows=rows, warps=warps, loads=loads, inflight=inflight))
    return out


def selected_tiling(shape: str) -> dict:
    """What kernel selection builds beside the 16-bit tile kernel (``templates/bsr_linear/select.py``): TVM side."""
    from types import SimpleNamespace
    from sparta.target import load_target
    from sparta.templates.bsr_linear.select import fp16_gemv_tiling
    n, k, gate = SHAPES[shape]
    mask = mask_of(shape)
    site = SimpleNamespace(any_rows=True, m=1, n=2 * n if gate else n, k=k, gate=gate,
                           block_mask=lambda bn, bk, gate_n=0: mask)
    return fp16_gemv_tiling(site, TILE, load_target("cuda"))


def kernels(build_rows=ROWS) -> dict:
    """Kernel name (its folder under ``artifacts/cuda/``) -> spec."""
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    specs = {}
    for shape, (n, k, gate) in SHAPES.items():
        common = dict(bias=False, act=act_of(shape), dtype=DTYPE, gate=gate, pdl=True, **TILE)
        for v in variants(shape, build_rows):
            name = f"{PREFIX}{shape}_r{v['rows']}_w{v['warps']}_l{v['loads']}_i{v['inflight']}"
            specs[name] = BsrGemvSpec(n, k, **common, **v, name=name)
        name = f"{PREFIX}{shape}_sel"
        sel = {k_: v for k_, v in selected_tiling(shape).items() if k_ != "one_row"}   # the one-row build: a variant
        specs[name] = BsrGemvSpec(n, k, **{**common, **sel}, name=name)
    return specs


def tile_kernels() -> dict:
    """``--tiles``: kernel name -> the tile kernel's spec (``BsrSpec`` for any rows)."""
    from sparta.templates.bsr_linear.spec import BsrSpec
    specs = {}
    for shape, (n, k, gate) in SHAPES.items():
        for t in TILES:
            for stages in STAGES:
                name = f"{TILE_PREFIX}{shape}_tm{t['tm']}_w{t['warps_m']}x{t['warps_n']}_s{stages}"
                specs[name] = BsrSpec(0, n, k, **t, stages=stages, bias=False, act=act_of(shape), dtype=DTYPE,
                                      gate=gate, name=name, **TILE)
    return specs


def cubin_registers(path: Path) -> int | None:
    """Registers a thread of the cubin's kernel holds (``EIATTR_REGCOUNT`` of its ``.nv.info``), None if not found."""
    b = Path(path).read_bytes()
    shoff, = struct.unpack_from("<Q", b, 0x28)
    size, count, names = struct.unpack_from("<HHH", b, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * size) for i in range(count)]
    strings = sections[names][4]
    for sec in sections:
        name = b[strings + sec[0]: b.index(b"\0", strings + sec[0])]
        if not name.startswith(b".nv.info"):
            continue
        data, i = b[sec[4]: sec[4] + sec[5]], 0
        while i + 2 <= len(data):
            fmt, attr = data[i], data[i + 1]
            if fmt == 4:                                     # a sized value
                n, = struct.unpack_from("<H", data, i + 2)
                if attr == 0x2F and n == 8:                  # EIATTR_REGCOUNT: (function, registers)
                    return struct.unpack_from("<II", data, i + 4)[1]
                i += 4 + n
            elif fmt in (1, 2, 3):                           # no value, a byte, a half word
                i += (2, 4, 4)[fmt - 1]
            else:
                break
    return None


def build(build_rows=ROWS, jobs: int = 2, tiles: bool = False) -> None:
    from concurrent.futures import ThreadPoolExecutor
    from sparta.codegen.cuda_build import build_cuda, cuda_templates, save_dir
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.spec import BsrSpec
    kind, prefix = (BsrSpec, TILE_PREFIX) if tiles else (BsrGemvSpec, PREFIX)
    template, specs = cuda_templates()[kind], tile_kernels() if tiles else kernels(build_rows)
    for old in ROOT.glob(f"{prefix}*"):
        if old.is_dir() and old.name not in specs:
            shutil.rmtree(old)
    t0 = time.perf_counter()

    def one(item):
        name, spec = item
        art = build_cuda(template, spec, archs=ARCHS)
        dest = ROOT / name
        shutil.rmtree(dest, ignore_errors=True)
        save_dir(art, dest)
        (dest / "kernel.cu").unlink(missing_ok=True)
        return name, spec, art, cubin_registers(dest / f"kernel.{ARCHS[0]}.cubin")

    ROOT.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(jobs) as pool:
        for name, spec, art, regs in pool.map(one, specs.items()):
            size = f"{spec.row_blocks} block rows x {spec.threads}" if tiles else f"{spec.ctas} CTAs x {32 * spec.warps}"
            print(f"{name}: {size} threads, {regs} registers{' (cached)' if art.cached else ''}", flush=True)
    print(f"{len(specs)} kernels in {time.perf_counter() - t0:.0f} s into {ROOT}/{prefix}*")



def variant(folder: Path, shape: str, tiles: bool) -> tuple:
    """(the most rows it takes, its row of the JSON, ``make(wp, table, bias)`` -> op) of a built kernel folder."""
    from sparta.templates.bsr_linear.gemv_spec import BsrGemvSpec
    from sparta.templates.bsr_linear.launchers import BsrLinearOp, load_spec
    from sparta.templates.bsr_linear.runtime import BsrGemvOp
    regs = cubin_registers(folder / f"kernel.{ARCHS[0]}.cubin")
    name = folder.name[len(TILE_PREFIX if tiles else PREFIX) + len(shape) + 1:]
    if tiles:
        spec = load_spec(folder)
        row = {"variant": name, "tm": spec.tm, "warps_m": spec.warps_m, "warps_n": spec.warps_n,
               "stages": spec.stages, "block_rows": spec.row_blocks, "registers": regs,
               "knobs": f"tm {spec.tm}, {spec.warps_m}x{spec.warps_n} warps, {spec.stages} stages"}
        return 1 << 30, row, lambda p, t, b: BsrLinearOp.packed(folder, spec, p, t)
    spec = BsrGemvSpec(**json.loads((folder / "spec.json").read_text()))
    row = {"variant": name, "rows": spec.rows, "warps": spec.warps, "loads": spec.lane_loads,
           "inflight": spec.inflight, "unit_rows": spec.unit_rows, "ctas": spec.ctas, "registers": regs,
           "knobs": f"rows {spec.rows}, {spec.warps} warps, loads {spec.lane_loads}, inflight {spec.inflight}, "
                    f"{spec.ctas} CTAs"}
    return spec.rows, row, lambda p, t, b: BsrGemvOp(folder, spec, p, t, b)


def bench_shape(shape: str, bw: float, ms=ROWS, tiles: bool = False) -> dict:
    from sparta.templates.bsr_linear.packing import pack_weight
    from sparta.templates.bsr_linear.spec import BsrSpec, reference

    n, k, gate = SHAPES[shape]
    act, dt = act_of(shape), torch.bfloat16
    mask = mask_of(shape)
    torch.manual_seed(n + k)
    w = (torch.randn((2 if gate else 1) * n, k, device="cuda") * 0.05).to(dt)
    tile = BsrSpec(0, n, k, tm=64, warps_m=2, bias=False, act=act, dtype=DTYPE, gate=gate, **TILE)
    wp, table = pack_weight(w, tile, mask)
    bias = torch.zeros((2 if gate else 1) * n, device="cuda", dtype=dt)     # read by no kernel: bias=False
    kept = int(mask.sum()) * BLOCK * BLOCK * 2
    sets = max(2, math.ceil(ROTATE_BYTES / kept))
    weights = [(wp, table)] + [(wp.clone(), table.clone()) for _ in range(sets - 1)]
    floor_us = kept / bw / 1e3
    prefix, sel_name = (TILE_PREFIX, "tm32_w2x1_s4") if tiles else (PREFIX, "sel")
    folders = sorted(f for f in ROOT.glob(f"{prefix}{shape}_*") if (f / "spec.json").is_file())
    if not folders:
        raise SystemExit(f"no {prefix}{shape}_* kernels under {ROOT}: build them with --build")
    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device="cuda").to(dt) for _ in range(sets)]
        ref = reference(xs[0], w, mask, None, act, BLOCK, BLOCK, gate=gate)
        for folder in folders:
            most, row, make = variant(folder, shape, tiles)
            if m > most:
                continue
            row["m"] = m
            try:
                ops = [make(p, t, bias) for p, t in weights]
                for op in ops[1:]:
                    op.kernel = ops[0].kernel          # one loaded module serves every weight set
                y = ops[0](xs[0])
                torch.cuda.synchronize()
                row["max_rel_err"] = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                try:
                    torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=1e-2)
                    row["ok"] = True
                except AssertionError as exc:
                    row["ok"], row["error"] = False, str(exc).splitlines()[0][:300]
                row["kernel_us"] = gpu_kernel_us(lambda i: ops[i](xs[i]), sets)
                row["floor_pct"] = 100 * floor_us / row["kernel_us"]
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is recorded, the sweep goes on
                row["ok"], row["error"] = False, f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
    best, base = {}, {}
    for m in ms:
        timed = sorted((r for r in rows if r["m"] == m and "kernel_us" in r), key=lambda r: r["kernel_us"])
        print(f"\n{shape} {n}x{k}{' gated' if gate else ''}, M={m}: floor {floor_us:.2f} us "
              f"({kept / 1e6:.1f} MB kept)")
        print(f"  {'variant':<16}{'knobs':<52}{'regs':>5}{'us':>8}{'floor%':>7}  check")
        for r in timed + [r for r in rows if r["m"] == m and "kernel_us" not in r]:
            us = f"{r['kernel_us']:8.2f}{r['floor_pct']:7.0f}" if "kernel_us" in r else f"{'-':>8}{'-':>7}"
            err = f" (err {r['max_rel_err']:.1e})" if "max_rel_err" in r else ""
            print(f"  {r['variant']:<16}{r['knobs']:<52}{r['registers'] or '?':>5}{us}  "
                  f"{'ok' if r['ok'] else 'FAIL ' + r['error']}{err}", flush=True)
        good = [r for r in timed if r["ok"]]
        if good:
            best[str(m)] = {k_: good[0][k_] for k_ in ("variant", "kernel_us", "floor_pct")}
        sel = next((r for r in timed if r["variant"] == sel_name), None)
        if sel is not None:
            base[str(m)] = {k_: sel[k_] for k_ in ("variant", "knobs", "kernel_us", "floor_pct", "ok")}
        if good and sel is not None:
            print(f"  best {good[0]['variant']} {good[0]['kernel_us']:.2f} us vs selection's {sel['kernel_us']:.2f} us "
                  f"({sel['kernel_us'] / good[0]['kernel_us']:.2f}x)")
    return {"shape": shape, "n": n, "k": k, "gate": gate, "act": act, "density": DENSITY, "kept_bytes": kept,
            "weight_sets": sets, "floor_us": floor_us, "best": best, "selection": base, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="build the kernels (TVM + nvcc) and exit")
    ap.add_argument("--list", action="store_true", help="print the kernels' names and exit")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS),
                    help="the most rows of the builds, and the M each is run at")
    ap.add_argument("--tiles", action="store_true", help="the tile kernel for any rows instead, at M = 8 and 16")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    if args.list:
        print(" ".join(tile_kernels() if args.tiles else kernels(args.rows)))
        return
    if args.build:
        build(args.rows, tiles=args.tiles)
        return
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; torch {torch.__version__}", flush=True)
    shapes = [bench_shape(s, bw, TILE_ROWS if args.tiles else args.rows, args.tiles) for s in args.shapes]
    print("\nbest per shape and M (selection's in brackets):")
    for s in shapes:
        for m, b in s["best"].items():
            sel = s["selection"].get(m)
            print(f"  {s['shape']:<6} M={m}: {b['variant']:<14} {b['kernel_us']:6.2f} us ({b['floor_pct']:.0f}% of "
                  f"floor {s['floor_us']:.2f})" + (f" [sel {sel['kernel_us']:.2f}]" if sel else ""))
    path = save("bsr_tile_7b" if args.tiles else "bsr_gemv_7b", {"copy_GBps": bw, "archs": list(ARCHS),
                                                                  "shapes": shapes})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, args.out)
    print(f"wrote {path}" + (f" and {args.out}" if args.out else ""))


if __name__ == "__main__":
    main()
