"""Shared helpers for benchmark scripts: device description, result files."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

RESULTS = Path(os.environ.get("SPARTA_RESULTS", Path(__file__).parent / "results"))


def build_or_time(doc: str, default_dir, build, extend=None) -> argparse.Namespace | None:
    """The arguments of a kernel benchmark built where TVM is (``--build [DIR] [--jobs N]``) and timed on the GPU
    (``--dir DIR [--out FILE]``); ``extend(parser)`` adds the script's own. With ``--build`` it runs
    ``build(Path(DIR), jobs)`` and returns None."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--build", nargs="?", const=str(default_dir), metavar="DIR",
                    help=f"build the kernels (TVM + nvcc) into DIR (default {default_dir}) instead of timing them")
    ap.add_argument("--dir", default=str(default_dir), help="the built kernels' folder, when timing")
    ap.add_argument("--out", metavar="FILE", help="also write the results JSON to FILE")
    ap.add_argument("--jobs", type=int, default=2)
    if extend is not None:
        extend(ap)
    args = ap.parse_args()
    if args.build:
        build(Path(args.build), args.jobs)
        return None
    return args


def copy_bandwidth() -> float:
    """GB/s of a 256 MiB device-to-device copy, bytes read plus written (the benchmarks' bytes floor)."""
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / gpu_kernel_us(lambda i: b.copy_(a), 1, per_graph=10) / 1e3


def build_folders(template, specs: dict, folder: Path, jobs: int, archs=None) -> None:
    """Build each named spec's kernel of ``template`` (TVM + nvcc, cached) into ``folder/<name>`` (cubins and
    launch.json; no CUDA source), with ``manifest.json`` of the names and ``spec.key()``, on ``jobs`` threads."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor
    from sparta.codegen.cuda_build import build_cuda, save_dir
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def one(item):
        name, spec = item
        art = build_cuda(template, spec, **({"archs": archs} if archs else {}))
        dest = folder / name
        shutil.rmtree(dest, ignore_errors=True)
        save_dir(art, dest)
        (dest / "kernel.cu").unlink(missing_ok=True)
        return name, spec, art

    manifest = []
    with ThreadPoolExecutor(jobs) as pool:
        for name, spec, art in pool.map(one, specs.items()):
            smem = f" smem {spec.shared_bytes}" if hasattr(spec, "shared_bytes") else ""
            print(f"{name}: grid {art.launch['grid']} block {art.launch['block']}{smem}"
                  f"{' (cached)' if art.cached else ''}", flush=True)
            manifest.append({"name": name, "spec": spec.key()})
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"{len(specs)} kernels ({size / 1e6:.1f} MB) in {time.perf_counter() - t0:.0f} s into {folder}")


def interleaved(fns: dict, reps: int) -> dict:
    """Median ms of each function, calls interleaved so machine drift hits all alike."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_mask(rows: int, cols: int, density: float, tag: str) -> torch.Tensor:
    """A seeded random block mask, the same on every machine (kernels with the pattern baked in
    are built on one machine and benchmarked on another)."""
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    return torch.rand(rows, cols, generator=g) < density


def gpu_kernel_us(fn, variants: int, reps: int = 5, per_graph: int = 40) -> float:
    """Median µs of ``fn(i)`` on the GPU alone: ``per_graph`` calls (cycling ``i`` over
    ``variants`` input sets, to defeat L2) captured in one CUDA graph and replayed; falls back
    to CUDA events over back-to-back calls where the work cannot be captured."""
    for i in range(variants):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = None
    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn(0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(per_graph):
                fn(i % variants)
        graph.replay()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - not capturable (host-side sparse setup): time eagerly
        graph = None
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for i in range(per_graph):
                fn(i % variants)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_graph)
    return statistics.median(times)


def gpu_wall_us(fn, variants: int, iters: int = 50, windows: int = 1) -> float:
    """µs per call from the host's clock, synchronised at the end of each window of ``iters`` calls: what an eager
    caller waits; the median over ``windows`` windows (one host stall, e.g. a garbage collection, moves one window
    only)."""
    for i in range(variants):
        fn(i)
    torch.cuda.synchronize()
    means = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for i in range(iters):
            fn(i % variants)
        torch.cuda.synchronize()
        means.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(means)


def gpu_busy_us(fn, reps: int = 5, by_kernel: dict | None = None, top: int | None = 25) -> float:
    """GPU time of one call: the sum of its kernels' device times (profiler), without idle gaps; ``by_kernel`` gets
    each kernel's µs per call and calls per call, the ``top`` largest first (None: all)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [ev for ev in prof.key_averages() if ev.device_type == torch.autograd.DeviceType.CUDA]
    if by_kernel is not None:
        for ev in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
            us, calls = by_kernel.get(ev.key[:90], (0.0, 0))       # keys cut to 90 characters may meet
            by_kernel[ev.key[:90]] = [round(us + ev.self_device_time_total / reps, 2), calls + ev.count // reps]
    return sum(ev.self_device_time_total for ev in events) / reps


def first_tensor(out) -> torch.Tensor:
    """The first output (the last hidden state) of a model's tuple, dict or Hugging Face output."""
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    if isinstance(out, dict):
        return next(iter(out.values()))
    return out[0] if isinstance(out, (tuple, list)) else out


def torch_compile_peers(models: dict, call, modes=("default", "reduce-overhead"), iters: int = 50,
                        windows: int = 1) -> dict:
    """Each of ``models`` (name -> module) through ``torch.compile`` in each mode, called as ``call(name, fn)``:
    µs per forward by the host clock, compile time (three first calls) and the largest difference of the first
    output from the module uncompiled. Sparta's models compile with ``fullgraph=True`` (no graph break allowed)."""
    out = {}
    for name, m in models.items():
        with torch.no_grad():
            want = first_tensor(call(name, m)).clone()
            for mode in modes:
                torch._dynamo.reset()
                fn = torch.compile(m, mode=mode, fullgraph=name.startswith("sparta"))
                t0 = time.perf_counter()
                for _ in range(3):
                    got = call(name, fn)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                diff = float((first_tensor(got).float() - want.float()).abs().max())
                out[f"{name}@{mode}"] = {"wall_us": gpu_wall_us(lambda i: call(name, fn), 1, iters, windows),
                                         "compile_s": compile_s, "max_abs_diff": diff}
    return out


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    from sparta.codegen.profile import cpu_model
    return f"{cpu_model() or platform.processor() or 'cpu'} ({os.cpu_count()} cores)"


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    date = datetime.date.today().isoformat()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    path = RESULTS / f"{name}-{dev}-{date}.json"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    meta = {"device": device_name(), "date": date, "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "commit": commit}
    path.write_text(json.dumps({"meta": meta, **payload}, indent=1))
    return path
