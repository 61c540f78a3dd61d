"""One thread pool for the CPU: sparta's TVM kernels run their parallel loops on torch's OpenMP threads.

A compiled CPU model alternates TVM kernels and torch ops. TVM's LLVM kernels launch their parallel loops through
``__TVMBackendParallelLaunch``, a function pointer each kernel library holds, which TVM's runtime points at its own
thread pool. Two pools on the same cores spin against each other after every call (torch's OpenMP workers wait
actively for the next region; the TVM kernel's workers find their cores taken). Here that pointer is set, per loaded
library, to a launcher that runs the loop as an OpenMP parallel region of the OpenMP runtime torch itself uses: one
pool, whose workers torch's last op just left spinning and ready, sized by ``torch.get_num_threads()``.

The launcher is a few lines of C compiled once per machine with the C compiler TVM already needs for CPU kernels
(``cc -fopenmp``), cached beside the kernels. ``SPARTA_CPU_THREADS=tvm`` keeps TVM's own pool.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from pathlib import Path

LAUNCHER_C = r"""
#include <omp.h>
#include <stdint.h>
typedef struct { void* sync_handle; int32_t num_task; } TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

int sparta_omp_parallel_launch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  int n = num_task > 0 ? num_task : omp_get_max_threads();
  int failed = 0;
  if (n <= 1 || omp_in_parallel()) {
    TVMParallelGroupEnv env = {0, 1};
    return flambda(0, &env, cdata);
  }
#pragma omp parallel num_threads(n)
  {
    TVMParallelGroupEnv env = {0, omp_get_num_threads()};
    if (flambda(omp_get_thread_num(), &env, cdata) != 0) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed ? -1 : 0;
}

int sparta_omp_parallel_barrier(int task_id, TVMParallelGroupEnv* penv) {
  (void)task_id; (void)penv;
#pragma omp barrier
  return 0;
}
"""
POINTERS = {"__TVMBackendParallelLaunch": "sparta_omp_parallel_launch",
            "__TVMBackendParallelBarrier": "sparta_omp_parallel_barrier"}


def mode() -> str:
    """``"openmp"`` (the default: torch's pool) or ``"tvm"`` (TVM's own, ``SPARTA_CPU_THREADS=tvm``)."""
    value = os.environ.get("SPARTA_CPU_THREADS", "openmp")
    return value if value in ("openmp", "tvm") else "openmp"


def torch_openmp() -> Path | None:
    """The GNU OpenMP runtime torch loaded into this process (None: another runtime, or none)."""
    import torch  # noqa: F401  (loads it)
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines()
             if Path(line.split()[-1]).name.startswith("libgomp")}     # not the launcher, cached under its name
    return Path(sorted(paths)[0]) if len(paths) == 1 else None


def _load(lib: Path):
    """The launcher library at ``lib`` if it loads and holds every launch function, else None."""
    try:
        omp = ctypes.CDLL(str(lib))
    except OSError:
        return None
    return omp if all(hasattr(omp, function) for function in POINTERS.values()) else None


def _succeeds(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, text=True).returncode == 0
    except OSError:
        return False


def _build(folder: Path, gomp: Path) -> Path | None:
    """Compile the launcher into a file of this process's own (source and object too: processes build it at once),
    checked before it is published."""
    src, obj, tmp = (folder / f"launcher.{os.getpid()}.{ext}" for ext in ("c", "o", "so"))   # not with_suffix:
    #                                                                    it would replace the pid, the names collide
    src.write_text(LAUNCHER_C)
    cc = os.environ.get("CC", "cc")
    steps = ([cc, "-O2", "-fPIC", "-fopenmp", "-c", str(src), "-o", str(obj)],
             [cc, "-shared", str(obj), str(gomp), "-o", str(tmp)])      # needs torch's runtime, by its soname
    try:
        if all(_succeeds(step) for step in steps) and _load(tmp) is not None:
            return tmp
        tmp.unlink(missing_ok=True)
        return None
    finally:
        src.unlink(missing_ok=True)
        obj.unlink(missing_ok=True)


@functools.lru_cache(maxsize=None)
def launcher():
    """The OpenMP launcher library (ctypes), linked to torch's own OpenMP runtime, or None where it cannot be
    built (no such runtime, no C compiler with OpenMP): then TVM's pool runs the kernels, as before."""
    from ..codegen.cache import cache_root

    gomp = torch_openmp()
    if gomp is None:
        return None
    folder = cache_root() / "omp_launcher" / gomp.name
    lib = folder / "launcher.so"
    omp = _load(lib) if lib.is_file() else None
    if omp is None:                       # absent, or broken (a crash mid-write in an older version): rebuild
        folder.mkdir(parents=True, exist_ok=True)
        built = _build(folder, gomp)
        if built is None:
            return None
        os.replace(built, lib)
        omp = _load(lib)
    return omp


def describe() -> str:
    """Which threads run the CPU kernels' parallel loops, for the kernel report."""
    import torch
    if mode() == "tvm":
        return "CPU kernels run on TVM's thread pool (SPARTA_CPU_THREADS=tvm)"
    if launcher() is None:
        return ("CPU kernels run on TVM's thread pool: no OpenMP launcher (torch's runtime is not GNU OpenMP, "
                "or no C compiler with -fopenmp)")
    return f"CPU kernels run on torch's OpenMP threads ({torch.get_num_threads()}, torch.set_num_threads)"


def share_torch_pool(path: Path) -> bool:
    """Point the parallel launch of the loaded kernel library ``path`` at torch's OpenMP pool; False where it keeps
    TVM's (asked for, no launcher, or a library without parallel loops)."""
    if mode() != "openmp":
        return False
    omp = launcher()
    if omp is None:
        return False
    lib = ctypes.CDLL(str(path))          # the library TVM loaded: dlopen hands back the same image
    shared = False
    for pointer, function in POINTERS.items():
        try:
            slot = ctypes.c_void_p.in_dll(lib, pointer)
        except ValueError:
            continue
        slot.value = ctypes.cast(getattr(omp, function), ctypes.c_void_p).value
        shared = True
    return shared


__all__ = ["share_torch_pool", "launcher", "mode", "torch_openmp", "describe"]
