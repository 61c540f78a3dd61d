"""Build a CUDA kernel through TVM: CUDA C from TVM, cubins from nvcc, a JSON launch spec.

Works on a machine without a GPU (nothing is run). The artifact is a folder in the
kernel cache holding ``kernel.cu``, one ``kernel.<arch>.cubin`` per architecture and
``launch.json`` (entry name, grid, block, dynamic shared memory, the arguments in launch
order with dtype and shape, each cubin's SHA-256). ``sparta.runtime.cuda`` loads it
without TVM.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import CodegenError
from ..templates import registry
from . import cache
from .build import _PARSE, _source_digest
from .tvm_env import tvm, versions

ARCHS = ("sm_80", "sm_90")
NVCC_FLAGS = ("-O3", "-diag-suppress", "177,550", "--expt-relaxed-constexpr")


@dataclass
class CudaArtifact:
    path: Path          # the cache folder
    launch: dict        # launch.json
    cached: bool
    build_s: float


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    exe = shutil.which("nvcc")
    if exe is None:
        raise CodegenError("building CUDA kernels needs nvcc (the CUDA toolkit) on PATH")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out else "?"


def build_cuda(template, spec, archs=ARCHS) -> CudaArtifact:
    """``template(spec)`` (an IRModule with one PrimFunc ``spec.name``) → cached CUDA artifact, with
    cubins for ``spec.archs`` if the spec names them (e.g. ``sm_90a`` for wgmma), else ``archs``."""
    key = _key(template, spec, archs)
    archs = _archs(spec, archs)
    t0 = time.perf_counter()
    path = cache.lookup(key, "launch.json")
    if path is not None:
        launch = json.loads(path.read_text())
        if _cubins_intact(path.parent, launch):
            _write_spec(path.parent, spec)
            return CudaArtifact(path.parent, launch, True, time.perf_counter() - t0)
        cache.invalidate(key)
    with _PARSE:
        mod = template(spec)
    source, launch = _lower(mod, spec.name, archs[0])
    if hasattr(spec, "shared_bytes"):     # dynamic shared memory the template sized itself
        launch["shared_bytes"] = int(spec.shared_bytes)
    if getattr(spec, "pdl", False):       # launched with programmatic dependent launch where the GPU has it
        launch["pdl"] = True
        source = coherent_params(source)

    def write(launch_path: Path):
        folder = launch_path.parent
        (folder / "kernel.cu").write_text(source)
        launch["cubins"] = compile_cubins(folder, archs)
        launch_path.write_text(json.dumps(launch, indent=1))
        _write_spec(folder, spec)

    path = cache.store(key, "launch.json", write, {"name": spec.name, "kind": "cuda"})
    return CudaArtifact(path.parent, json.loads(path.read_text()), False, time.perf_counter() - t0)


def coherent_params(source: str) -> str:
    """``source`` with no ``__restrict__`` pointer parameter, for a kernel built for programmatic dependent launch.

    TVM declares every buffer ``__restrict__``; nvcc then reads one the kernel never writes through the non-coherent
    read-only path (``ld.global.nc``), which promises the data does not change while the kernel runs, so ptxas may
    move those loads above ``griddepcontrol.wait``. A programmatically dependent kernel runs while the kernel before
    it still writes its inputs: such a load read the previous kernel's output before it was written (wrong tokens
    inside generate()'s CUDA graphs, where the kernels run back to back)."""
    return source.replace(" __restrict__ ", " ")


def _key(template, spec, archs=ARCHS) -> str:
    return cache.cache_key({"template": f"{template.__module__}.{template.__name__}", "spec": spec.key(),
                            "archs": list(_archs(spec, archs)), "versions": versions(), "nvcc": nvcc_version(),
                            "source": _source_digest(inspect.getmodule(template)),
                            "coherent": bool(getattr(spec, "pdl", False))})


def build_jobs() -> int:
    """Worker processes for :func:`prebuild`: ``SPARTA_BUILD_JOBS``, else one per core (1: build in this process)."""
    try:
        return max(1, int(os.environ.get("SPARTA_BUILD_JOBS") or os.cpu_count() or 1))
    except ValueError:
        raise CodegenError(f"SPARTA_BUILD_JOBS must be a number of processes, got "
                           f"{os.environ['SPARTA_BUILD_JOBS']!r}") from None


def prebuild(items, jobs: int | None = None, progress=None) -> int:
    """Build the kernels of ``items`` ((template, spec) pairs; repeats built once) that the cache lacks, in a pool of
    ``jobs`` processes (default :func:`build_jobs`), so the builds that follow find them cached. Returns how many were
    built. ``progress(n)`` is told of each one done."""
    todo = {}
    for template, spec in items:
        key = _key(template, spec)
        if key not in todo and cache.lookup(key, "launch.json") is None:
            todo[key] = (template, spec)
    jobs = build_jobs() if jobs is None else jobs
    if jobs <= 1 or len(todo) <= 1:
        for template, spec in todo.values():
            build_cuda(template, spec)
            progress and progress(1)
        return len(todo)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in as_completed([pool.submit(_build_one, t, s) for t, s in todo.values()]):
            done.result()
            progress and progress(1)
    return len(todo)


def _build_one(template, spec) -> None:
    build_cuda(template, spec)


def tvm_source(template, spec) -> str:
    """The CUDA C TVM emits for ``template(spec)`` (no nvcc)."""
    with _PARSE:
        mod = template(spec)
    return _emit(mod, spec.name, _archs(spec)[0])


def cuda_source(template, spec) -> str:
    """The ``kernel.cu`` that ``build_cuda`` compiles for ``template(spec)``: TVM's source, with
    :func:`coherent_params` for a kernel built for programmatic dependent launch (no nvcc)."""
    source = tvm_source(template, spec)
    return coherent_params(source) if getattr(spec, "pdl", False) else source


def cuda_templates() -> dict:
    """Spec type → the template that builds it, for every CUDA kernel family (``sparta.templates.registry``)."""
    return registry.cuda_templates()


def build_folders(specs: dict, out: Path, jobs: int = 2, templates: dict | None = None, log=print) -> None:
    """Build every ``name -> spec`` of ``specs`` through ``templates[type(spec)]`` (default: :func:`cuda_templates`)
    into ``out/<name>/`` (source, cubins, launch.json, spec.json), ``jobs`` at a time; ``log`` gets a line each."""
    templates = cuda_templates() if templates is None else templates
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def one(item):
        name, spec = item
        t0 = time.perf_counter()
        art = build_cuda(templates[type(spec)], spec)
        dest = out / name
        shutil.rmtree(dest, ignore_errors=True)
        save_dir(art, dest)
        return name, art, time.perf_counter() - t0

    with ThreadPoolExecutor(jobs) as pool:
        for name, art, dt in pool.map(one, specs.items()):
            log(f"{name}: grid {art.launch['grid']} block {art.launch['block']} smem {art.launch['shared_bytes']} "
                f"({'cached' if art.cached else f'built in {dt:.1f} s'})")


def compile_cubins(folder: Path, archs) -> dict:
    """nvcc ``folder/kernel.cu`` into ``kernel.<arch>.cubin`` for each arch: launch.json's ``cubins`` entry."""
    cubins = {}
    for arch in archs:
        cubin = folder / f"kernel.{arch}.cubin"
        _nvcc(folder / "kernel.cu", cubin, arch)
        cubins[arch] = {"file": cubin.name, "sha256": cache.file_digest(cubin)}
    return cubins


def _write_spec(folder: Path, spec) -> None:
    """``spec.json``: the spec the kernel was built from, for the TVM-free runtime (an entry cached
    before specs were recorded gets it on a hit: written beside, renamed in, so no reader sees half)."""
    if dataclasses.is_dataclass(spec) and not (folder / "spec.json").is_file():
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".spec.", suffix=".tmp", delete=False) as f:
            f.write(json.dumps(dataclasses.asdict(spec)))
        os.replace(f.name, folder / "spec.json")


def _cubins_intact(folder: Path, launch: dict) -> bool:
    for info in launch.get("cubins", {}).values():
        f = folder / info["file"]
        if not f.is_file() or cache.file_digest(f) != info["sha256"]:
            return False
    return bool(launch.get("cubins"))


def _nvcc(src: Path, out: Path, arch: str) -> None:
    nvcc_version()
    # the arch-specific targets (wgmma, setmaxnreg: sm_90a) need the -gencode spelling
    target = f"-gencode=arch=compute_{arch[3:]},code={arch}" if arch.endswith("a") else f"-arch={arch}"
    r = subprocess.run(["nvcc", "-cubin", target, *NVCC_FLAGS, str(src), "-o", str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise CodegenError(f"nvcc failed for {src.name} ({arch}):\n{r.stderr[-2000:]}")


def _archs(spec, default=ARCHS) -> tuple:
    """The architectures a spec's kernel is built for: the spec's own (``spec.archs``, e.g. wgmma's sm_90a), else
    ``default``; the source is emitted for the first."""
    return tuple(getattr(spec, "archs", None) or default)


def _emit(mod, name: str, arch: str) -> str:
    """The CUDA C TVM emits for ``mod``."""
    t = tvm()
    target = t.target.Target({"kind": "cuda", "arch": arch})
    try:
        with target:
            ex = t.compile(mod, target=target)
    except Exception as exc:  # noqa: BLE001 - report which kernel failed
        raise CodegenError(f"TVM could not build CUDA kernel {name!r}: {exc}") from exc
    return ex.mod.imports[0].inspect_source()


def _lower(mod, name: str, arch: str = ARCHS[0]) -> tuple[str, dict]:
    """CUDA C of ``mod`` and its launch spec (from the lowered device function)."""
    t = tvm()
    from tvm import tirx
    from tvm.tirx.build import split_host_device_mods

    target = t.target.Target({"kind": "cuda", "arch": arch})
    source = _emit(mod, name, arch)
    try:
        bound = tirx.transform.BindTarget(target.with_host(t.target.Target("llvm")))(mod)
        pipe, _, _ = tirx.get_tir_pipeline("default")
        _, dev_mods = split_host_device_mods(pipe(bound))
    except Exception as exc:  # noqa: BLE001 - report which kernel failed
        raise CodegenError(f"TVM could not build CUDA kernel {name!r}: {exc}") from exc
    kernels = [(gv.name_hint, f) for dm in dev_mods.values() for gv, f in dm.functions.items()]
    if len(kernels) != 1:
        raise CodegenError(f"kernel {name!r}: expected one device function, got {[k for k, _ in kernels]}")
    entry, func = kernels[0]
    sig = re.search(rf"__global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?{re.escape(entry)}\(([^)]*)\)", source)
    if sig is None:
        raise CodegenError(f"kernel {name!r}: entry {entry!r} not found in the CUDA source")
    buffers = {p.name: p for p in mod[name].params}  # 0.27: params carry name, dtype, shape
    sizes = {str(d): d for b in buffers.values() for d in b.shape if isinstance(d, tirx.Var)}
    args = []
    for param in sig.group(1).split(","):
        pname = param.strip().split()[-1]
        bname = pname[:-4] if pname.endswith("_ptr") else pname
        if bname in sizes and bname not in buffers:      # a size the kernel takes as a scalar (M for any rows)
            args.append({"name": bname, "dtype": str(sizes[bname].ty), "scalar": True})
            continue
        if bname not in buffers:
            raise CodegenError(f"kernel {name!r}: parameter {pname!r} is not a buffer of the PrimFunc")
        buf = buffers[bname]
        args.append({"name": bname, "dtype": str(buf.dtype),
                     "shape": [int(s) if isinstance(s, tirx.IntImm) else str(s) if str(s) in sig.group(1) else None
                               for s in buf.shape]})
    scalars = {a["name"] for a in args if a.get("scalar")}
    extents = {k: _extent(v, scalars, name) for k, v in _thread_extents(func.body, {}).items()}
    launch = {"entry": entry, "name": name,
              "grid": [extents.get(f"blockIdx.{a}", 1) for a in "xyz"],
              "block": [extents.get(f"threadIdx.{a}", 1) for a in "xyz"],
              "shared_bytes": int(extents.get("dyn_shared", 0)), "args": args,
              "tvm": versions(), "nvcc": nvcc_version()}
    if any(not isinstance(e, int) for e in launch["block"]) or not isinstance(launch["shared_bytes"], int):
        raise CodegenError(f"kernel {name!r}: its block and shared memory must not depend on a size argument")
    return source, launch


def _extent(value, scalars: dict, name: str):
    """A launch extent for launch.json: an int, or ``[size, t]`` = ceil(size / t) for an extent that follows a
    scalar size argument (a grid over any number of rows), checked at every size up to 4096."""
    from tvm import sym, tirx
    if isinstance(value, tirx.IntImm):
        return int(value)
    free = tirx.analysis.undefined_vars(value)
    if len(free) == 1 and free[0].name in scalars:
        var = free[0]

        def at(m):
            ana = sym.Analyzer()
            ana.bind(var, tirx.IntImm(str(var.ty), m))
            return int(ana.simplify(value))
        t = next((m for m in range(1, 4097) if at(m + 1) == 2), None)
        if t is not None and all(at(m) == -(-m // t) for m in range(1, 4097)):
            return [var.name, t]
    raise CodegenError(f"kernel {name!r}: launch extent {value} is neither a constant nor ceil(size / tile)")


def _thread_extents(stmt, out: dict) -> dict:
    from tvm import tirx
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent":
        out[stmt.node.var.name] = stmt.value
    for field in ("body", "then_case", "else_case"):
        child = getattr(stmt, field, None)
        if isinstance(child, tirx.Stmt):
            _thread_extents(child, out)
    for s in getattr(stmt, "seq", None) or []:
        _thread_extents(s, out)
    return out


def built_folder(template, spec, out=None) -> Path:
    """Build ``spec``'s kernel from ``template`` (cached); ``out``: also copy its folder to ``out/<spec.name>``.
    Returns the folder."""
    art = build_cuda(template, spec)
    return save_dir(art, Path(out) / spec.name) if out is not None else art.path


def save_dir(artifact: CudaArtifact, dest: Path) -> Path:
    """Copy an artifact folder (sources, cubins, launch spec) to ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in artifact.path.iterdir():
        if f.name != "meta.json":
            shutil.copy2(f, dest / f.name)
    return dest


__all__ = ["build_cuda", "build_folders", "prebuild", "build_jobs", "cuda_source", "cuda_templates", "CudaArtifact", "ARCHS", "save_dir",
           "built_folder"]
