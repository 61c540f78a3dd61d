"""Measure a hardware profile: the cost of each (kernel, block shape) on this machine.

    python -m sparta.codegen.profile --target cpu  -o passes/profiles/cpu.json
    python -m sparta.codegen.profile --target cuda -o passes/profiles/cuda.json   # on the GPU

Until sparta's own kernels exist for a (bits, block) pair, its cost is measured on the
closest stand-in that really runs here, and the profile's ``notes`` say which:

* dense GEMM: the vendor library (``F.linear``: MKL/oneDNN, cuBLAS; ``_int_mm``;
  fbgemm's dynamic int8 linear; tinygemm's ``_weight_int4pack_mm``);
* a BH×BW block: a batched GEMM over the weight's block rows, each with its kept blocks
  gathered side by side, ``bmm((rows, M, kb·BW), (rows, kb·BW, BH))`` at 10% blocks kept:
  the work of a block-sparse kernel that accumulates a row's blocks, with perfect gathering;
* 1×1 (fine-grained): CSR SpMM (``torch.sparse.mm``) per non-zero per row;
* kernels without a batched stand-in (int8 / int4 on the GPU): the fp16 block costs
  scaled by the measured dense-rate ratio.

No TVM is needed for the stand-ins: this runs on the GPU machine too. On the CPU, ``--kernels sparta`` measures
sparta's own kernels (fp32, W8A8, weight-only W8A32 and W4A32 blocks at 256 rows and at one row, the vendor GEMM at
few rows, the kernel module's call), and :func:`host_profile` is what ``compile`` plans with: the shipped profile on
the CPU model it was measured on, else a smaller one measured on first use and cached per CPU model.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..templates.onednn_int8 import runtime as cpu_int8

BLOCKS = [(64, 64), (32, 32), (16, 16), (1, 32), (1, 1)]
DENSE_ROWS = (1, 4, 16, 64)         # rows at which the CPU's vendor GEMM rate is measured beside the main one


def median_timer(device: str):
    """``run(fn, iters)``: the median µs of ``fn()`` over ``iters`` calls after one more (CUDA events around each
    call on ``"cuda"``, the host clock otherwise)."""
    if device == "cuda":
        def run(fn, iters):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            return statistics.median(times)
    else:
        def run(fn, iters):
            fn()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
    return run  # µs


def _rand(*shape, device, dtype):
    x = torch.randn(*shape, device=device)
    return torch.where(x == 0, torch.ones_like(x), x).to(dtype)


def measure(target: str, m: int | None = None, iters: int = 20, size: int | None = None) -> dict:
    device = "cuda" if target == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profiling the cuda target needs a GPU")
    timed = median_timer(device)
    m = m or (4096 if device == "cuda" else 128)
    n = k = size or (1024 if device == "cpu" else 3072)
    notes = {"dense": "vendor library through torch", "blocks": "bmm over blocks (stand-in for block-sparse)",
             "1x1": "torch.sparse.mm CSR SpMM (stand-in for fine-grained)", "rows": m}
    tiny = torch.randn(1, 1, device=device)

    def launches():
        for _ in range(100):
            torch.nn.functional.linear(tiny, tiny)
    fixed = timed(launches, iters) / 100
    if device == "cuda":
        big = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        copy_us = timed(big.clone, iters)
        bandwidth = 2 * big.numel() / (copy_us * 1e3)
    else:   # what streaming a model's weights gets: a read past the last-level cache on every thread
        big = torch.ones(64 << 20, dtype=torch.float32)
        bandwidth = 4 * big.numel() / (timed(big.sum, iters) * 1e3)
    del big

    float_kernels = [(32, 32, torch.float32)] + ([(16, 16, torch.float16)] if device == "cuda" else [])
    kernels = []
    for wb, ab, dt in float_kernels:
        x, w = _rand(m, k, device=device, dtype=dt), _rand(n, k, device=device, dtype=dt)
        dense_us = min(timed(lambda: torch.nn.functional.linear(x, w), iters) for _ in range(3))
        blocks = {}
        for bh, bw in BLOCKS:
            if (bh, bw) == (1, 1):
                ws = torch.where(torch.rand(n, k, device=device) < 0.05, w, torch.zeros((), device=device, dtype=dt))
                try:
                    csr = ws.to_sparse_csr()
                    xt = x.t().contiguous()
                    us = timed(lambda: torch.sparse.mm(csr, xt), iters)
                    blocks[(1, 1)] = us * 1e3 / (csr.values().numel() * m)
                except (RuntimeError, NotImplementedError):
                    continue
            else:
                rows, kb = n // bh, max(1, k // bw // 10)  # 10% of each block row kept
                xb = _rand(rows, m, kb * bw, device=device, dtype=dt)
                wblk = _rand(rows, kb * bw, bh, device=device, dtype=dt)
                us = timed(lambda: torch.bmm(xb, wblk), iters)
                blocks[(bh, bw)] = us * 1e3 / (rows * kb * m)
        by_rows = {}
        if device == "cpu":     # the vendor GEMM's rate is far from its peak at few rows (decode-sized GEMMs)
            for rows in DENSE_ROWS:
                if rows < m:
                    xr = _rand(rows, k, device=device, dtype=dt)
                    us = min(timed(lambda: torch.nn.functional.linear(xr, w), iters) for _ in range(3))
                    by_rows[str(rows)] = 2 * rows * n * k / (us * 1e3)
        kernels.append({"weight_bits": wb, "act_bits": ab, "dense_gflops": 2 * m * n * k / (dense_us * 1e3),
                        "blocks": blocks, **({"dense_gflops_rows": by_rows} if by_rows else {})})
    base = kernels[-1]  # fp16 on cuda, fp32 on cpu: the block-cost shape the integer kernels scale
    for wb, ab, rate, how in _integer_rates(device, m, n, k, timed, iters):
        scale = base["dense_gflops"] / rate
        kernels.append({"weight_bits": wb, "act_bits": ab, "dense_gflops": rate,
                        "blocks": {s: v * scale for s, v in base["blocks"].items()}})
        notes[f"W{wb}A{ab}"] = f"dense: {how}; blocks: W{base['weight_bits']} block costs x dense-rate ratio"
    name = torch.cuda.get_device_name(0) if device == "cuda" else _cpu_name()
    return {"target": target, "device": name, "date": datetime.date.today().isoformat(),
            "source": "measured on stand-ins (see notes) by python -m sparta.codegen.profile",
            "fixed_us": fixed, "bandwidth_gbs": bandwidth, "notes": notes,
            "sparse_ops": ["linear", "addmm", "mm", "matmul"],
            "kernels": [{**kk, "blocks": {f"{a}x{b}": v for (a, b), v in kk["blocks"].items()}} for kk in kernels]}


def _integer_rates(device, m, n, k, timed, iters):
    """(weight bits, act bits, dense GOP/s, how) for the integer kernels measurable here."""
    out = []
    if device == "cuda":
        a = torch.randint(-127, 127, (m, k), device=device, dtype=torch.int8)
        b = torch.randint(-127, 127, (n, k), device=device, dtype=torch.int8).t()  # column-major: cuBLASLt's fast path
        us = timed(lambda: torch._int_mm(a, b), iters)
        out.append((8, 8, 2 * m * n * k / (us * 1e3), "torch._int_mm (cuBLASLt int8)"))
        try:
            w = torch.randint(0, 16, (n, k // 2), device=device, dtype=torch.uint8)
            wpk = torch._convert_weight_to_int4pack(w, 8)
            sz = torch.rand(k // 128, n, 2, device=device, dtype=torch.bfloat16)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            us = timed(lambda: torch._weight_int4pack_mm(x, wpk, 128, sz), iters)
            out.append((4, 16, 2 * m * n * k / (us * 1e3), "torch._weight_int4pack_mm (tinygemm)"))
        except (RuntimeError, AttributeError):
            pass
    elif cpu_int8.available():
        bits = cpu_int8.host_code_bits()
        top = 2 ** (bits - 1) - 1
        codes = torch.randint(-top, top + 1, (n, k), dtype=torch.int8)
        lin = cpu_int8.Int8LinearCPU("profile", "x", codes, torch.rand(n) + 0.5, torch.randn(n), (m, n), bits)
        x = torch.randn(m, k)
        us = min(timed(lambda: lin(x), iters) for _ in range(3))
        out.append((8, 8, 2 * m * n * k / (us * 1e3), f"sparta's int8 linear (oneDNN u8·s8, {bits}-bit weight "
                                                    "codes, per-token quantiser included)"))
    return out


def measure_sparta_cpu(m: int = 256, size: int = 768, iters: int = 15, shapes=tuple(BLOCKS),
                       dismantle: str = "none", wide_k: int = 4096) -> dict:
    """Kernel costs of sparta's own CPU templates (replaces the stand-ins for the CPU target), for the block
    ``shapes`` given, at the dismantle level large ops get (the shipped policy: the generic kernel); block costs
    on a ``size`` square weight and again at input width ``wide_k`` (0: not)."""
    from ..templates.cpu_linear import block_spec, fine_spec
    from ..templates.cpu_linear.fine import fine_linear
    from .build import build_cpu
    gen = torch.Generator().manual_seed(0)
    timed = median_timer("cpu")
    x = torch.randn(m, size, generator=gen)
    call_us = kernel_call_us(iters)        # first: a quiet process
    base = measure("cpu", m=m, iters=iters, size=size)
    kernels = []
    for wb, ab in ((32, 32), (8, 8), (8, 32), (4, 32)):
        blocks, one_row, wide = {}, {}, {}
        for bh, bw in shapes:
            if (bh, bw) == (1, 1):
                if wb != 32:
                    continue
                mask = torch.rand(size, size, generator=gen) < 0.05
                w = torch.randn(size, size, generator=gen)
                spec = fine_spec.spec_from_weight(m, w, mask, "tile", name=f"prof_fine_{m}_{size}")
                fn = build_cpu(fine_linear, spec).fn
                args = {"X": x, "Y": torch.empty(m, size), **fine_spec.pack(spec, w)}
                us = timed(lambda: fn(*[args[a] for a in fine_spec.argument_names(spec)]), iters)
                blocks[(1, 1)] = us * 1e3 / (spec.nnz * m)
                continue
            if wb == 4 and bh % 2:
                continue
            keep = torch.rand(size // bh, size // bw, generator=gen) < 0.1
            keep[0, 0] = True
            rows = tuple(tuple(torch.nonzero(keep[i]).flatten().tolist()) for i in range(size // bh))
            spec = block_spec.BlockLinearSpec(m, size, size, (bh, bw), rows, wb, dismantle=dismantle,
                                              name=f"prof_{wb}_{ab}_{bh}x{bw}_{m}_{size}",
                                              act_bits=ab if wb == 8 else 0)
            if dismantle == "none":
                spec = dataclasses.replace(spec, name=spec.generic_name())
            blocks[(bh, bw)] = _block_ns(spec, x, torch.randn(size, size, generator=gen), iters, timed)
            if wide_k and dismantle == "none":    # the same block rows' share of blocks over a wider K
                wide[(bh, bw)] = _wide_k_ns(spec, wide_k, iters, gen, timed)
            if dismantle == "none":   # one row, every block: what a decode step pays per block
                one_row[(bh, bw)] = _one_row_ns(spec, size, iters, gen, timed)
        vendor = next((k for k in base["kernels"] if (k["weight_bits"], k["act_bits"]) == (wb, ab)), None)
        dense = (vendor or base["kernels"][0])["dense_gflops"]
        kernels.append({"weight_bits": wb, "act_bits": ab, "dense_gflops": dense,
                        "blocks": {f"{a}x{b}": v for (a, b), v in blocks.items()},
                        "blocks_one_row": {f"{a}x{b}": v for (a, b), v in one_row.items()},
                        **({"dense_gflops_rows": vendor["dense_gflops_rows"]}
                           if vendor is not None and "dense_gflops_rows" in vendor else {}),
                        **({"weight_code_bits": cpu_int8.host_code_bits()} if wb == 8 else {}),
                        **({"dense_blocks": "32x32"} if ab == 32 and wb < 32 and (32, 32) in blocks else {}),
                        **({"blocks_wide_k": {f"{a}x{b}": v for (a, b), v in wide.items()}} if wide else {})})
    base["kernels"] = kernels
    base["kernel_call_us"] = call_us
    base["rows"] = m
    base["k"] = size
    if wide_k and dismantle == "none":
        base["wide_k"] = wide_k
        base["notes"]["blocks_wide_k"] = f"the same kernels at K = {wide_k}, {WIDE_K_KEPT:.0%} of the blocks kept (a " \
            "panel of X outgrows the core's L2)"
    base["stream_weights"] = True
    base["source"] = f"measured: sparta's CPU kernels ({dismantle}-dismantled, 10% blocks kept) by " \
                     "python -m sparta.codegen.profile --target cpu --kernels sparta"
    base["notes"]["blocks"] = "sparta block_linear kernels; 1x1: sparta fine_linear"
    base["notes"]["W4A32"] = base["notes"]["W8A32"] = "dense: sparta's block kernel over every 32x32 block (no " \
        "vendor kernel); blocks_one_row: the row-parallel generic kernel at one row over a dense weight"
    if "W8A8" in base["notes"]:
        base["notes"]["W8A8"] = base["notes"]["W8A8"].split("; blocks")[0] + "; blocks: sparta block_linear int8"
    return base


def _block_ns(spec, x: torch.Tensor, weight: torch.Tensor, iters: int, timed) -> float:
    """ns per block per row of sparta's block kernel of ``spec`` on ``x`` (M, K) and ``weight`` (N, K), the least
    disturbed of three medians."""
    from ..templates.cpu_linear import block_spec
    from ..templates.cpu_linear.block import block_linear
    from .build import build_cpu
    fn = build_cpu(block_linear, spec).fn
    args = {"Y": torch.empty(spec.m, spec.n), **block_spec.pack(spec, weight)}
    if spec.int8_activations:
        args["X"], args["XS"] = block_spec.quantize_rows(x)
    else:
        args["X"] = x
    us = min(timed(lambda: fn(*[args[a] for a in block_spec.argument_names(spec)]), iters) for _ in range(3))
    return us * 1e3 / (spec.n_blocks * spec.m)


def _one_row_ns(spec, size: int, iters: int, gen, timed) -> float:
    """ns per block of the generic kernel of ``spec``'s shape and bits at one row over a dense ``size`` square
    weight (the row-parallel path a decode step runs)."""
    bh, bw = spec.block
    rows = tuple(tuple(range(size // bw)) for _ in range(size // bh))
    one = dataclasses.replace(spec, m=1, rows=rows)
    one = dataclasses.replace(one, name=one.generic_name())
    weight = torch.randn(size, size, generator=gen)
    return _block_ns(one, torch.randn(1, size, generator=gen), weight, iters, timed)


WIDE_K_KEPT = 0.5      # blocks kept in the wide-K measurement: the cost of a block there grows with the kept share


def _wide_k_ns(spec, k: int, iters: int, gen, timed) -> float:
    """ns per block per row of the generic kernel of ``spec``'s rows, block and bits at input width ``k``
    (:data:`WIDE_K_KEPT` of the blocks kept)."""
    bh, bw = spec.block
    keep = torch.rand(spec.n // bh, k // bw, generator=gen) < WIDE_K_KEPT
    keep[:, 0] = True
    rows = tuple(tuple(torch.nonzero(keep[i]).flatten().tolist()) for i in range(spec.n // bh))
    wide = dataclasses.replace(spec, k=k, rows=rows)
    wide = dataclasses.replace(wide, name=wide.generic_name())
    return _block_ns(wide, torch.randn(spec.m, k, generator=gen), torch.randn(spec.n, k, generator=gen), iters,
                     timed)


def kernel_call_us(iters: int = 15) -> float:
    """Host time of one call of a sparta CPU kernel module on a one-block op (what every sparse sub-operator pays
    beside its blocks)."""
    from ..templates.cpu_linear.runtime import SparseLinearCPU, SubKernel
    from ..templates.cpu_linear import block_spec
    from ..templates.cpu_linear.block import block_linear
    from .build import build_cpu
    spec = block_spec.BlockLinearSpec(1, 32, 32, (32, 32), ((0,),), bias=True, name="prof_call_1x32x32")
    sub = SubKernel(build_cpu(block_linear, spec).fn, block_spec, spec, block_spec.pack(spec, torch.randn(32, 32)),
                    {"key": ""})
    module = SparseLinearCPU("profile", "x", [sub], 32, 32, 32, 32, (1, 32), torch.randn(32), None, None)
    x = torch.randn(1, 32)
    timed = median_timer("cpu")

    def calls():
        for _ in range(100):
            module(x)
    return min(timed(calls, iters) for _ in range(3)) / 100


HOST_SHAPES = ((64, 64), (32, 32))     # what a profile measured on first use covers (a few seconds of builds)


def host_profile(cache_dir=None):
    """The CPU profile of this machine: the shipped one where it was measured on this CPU model and core count,
    else one measured here on first use (:data:`HOST_SHAPES`, sparta's kernels) and kept in the kernel cache per
    CPU model. ``SPARTA_CPU_PROFILE`` = ``shipped`` | ``host`` (measure or reuse even where the shipped one fits)
    | a profile JSON path overrides."""
    from ..passes.transform.profile import HardwareProfile, load_profile
    from .cache import cache_root
    choice = os.environ.get("SPARTA_CPU_PROFILE", "")
    shipped = load_profile("cpu")
    if choice == "shipped":
        return shipped
    if choice not in ("", "host"):
        return load_profile(choice)
    here = _cpu_name()
    if choice != "host" and shipped.device == here:
        return shipped
    slug = "".join(c if c.isalnum() else "_" for c in here).strip("_")
    path = Path(cache_dir or cache_root()) / "profiles" / f"cpu-{slug}.json"
    if path.is_file():
        return load_profile(path)
    t0 = time.perf_counter()
    data = measure_sparta_cpu(m=128, size=768, iters=7, shapes=HOST_SHAPES)
    data["dismantle"] = shipped.to_json()["dismantle"]      # a policy measured once (the shipped notes say how)
    data["notes"]["dismantle"] = shipped.notes.get("dismantle", "")
    data["source"] = f"measured on this host on first use ({time.perf_counter() - t0:.1f} s): sparta's generic " \
                     "CPU kernels, 10% blocks kept"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return HardwareProfile.from_json(data)


def cpu_model() -> str | None:
    """This CPU's model name (``/proc/cpuinfo``), or None where the system does not say."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
    except (OSError, StopIteration):
        return None


def _cpu_name() -> str:
    return f"{cpu_model() or 'cpu'} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def main(argv=None):
    ap = argparse.ArgumentParser(description="measure a sparta hardware profile")
    ap.add_argument("--target", choices=["cpu", "cuda"], required=True)
    ap.add_argument("-o", "--output", help="write the profile JSON here (default: print)")
    ap.add_argument("--rows", type=int, default=None, help="activation rows M used for the measurements")
    ap.add_argument("--size", type=int, default=None, help="weight size N = K used for the measurements")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kernels", choices=["stand-in", "sparta"], default="stand-in",
                    help="measure block costs on stand-ins (vendor ops) or on sparta's own kernels")
    args = ap.parse_args(argv)
    if args.kernels == "sparta":
        if args.target != "cpu":
            raise SystemExit("sparta's own kernels are profiled on the cpu target here (CUDA: see the codegen issue)")
        prof = measure_sparta_cpu(args.rows or 256, args.size or 768, args.iters)
    else:
        prof = measure(args.target, args.rows, args.iters, args.size)
    text = json.dumps(prof, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
