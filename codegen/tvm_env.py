"""TVM, imported lazily: the compiler for builds, only its runtime library to run cached kernels.

Importing the ``tvm`` package costs seconds (it loads the whole compiler); running a
cached CPU kernel needs only ``tvm_ffi`` and ``libtvm_runtime`` (its thread pool), so a
warm compile never imports the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import struct
from pathlib import Path

from ..errors import CodegenError

_MISSING = ("compiling kernels needs TVM: pip install apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1")


def _set_threads() -> None:
    """TVM_NUM_THREADS defaults to the usable cores (TVM picks 1 on small VMs)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("TVM_NUM_THREADS", str(cores))


@functools.lru_cache(maxsize=1)
def tvm():
    """The ``tvm`` module (the compiler)."""
    _set_threads()
    try:
        import tvm as _tvm
    except ImportError as exc:  # pragma: no cover - TVM is a dependency; a GPU-only box may lack it
        raise CodegenError(_MISSING) from exc
    return _tvm


@functools.lru_cache(maxsize=1)
def runtime():
    """``tvm_ffi`` with TVM's runtime library loaded (what compiled CPU kernels call into)."""
    _set_threads()
    try:
        import tvm_ffi
        spec = importlib.util.find_spec("tvm")
    except ImportError as exc:  # pragma: no cover
        raise CodegenError(_MISSING) from exc
    libs = [Path(p) / "lib" / "libtvm_runtime.so" for p in (spec.submodule_search_locations or [])] if spec else []
    lib = next((p for p in libs if p.is_file()), None)
    if lib is None:
        raise CodegenError(f"TVM's runtime library (tvm/lib/libtvm_runtime.so) is missing; {_MISSING}")
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    return tvm_ffi


def load_kernel(path, name: str):
    """The function ``name`` of a compiled kernel library, without importing the compiler; its parallel loops run on
    torch's OpenMP threads (``sparta/runtime/cpu_threads.py``)."""
    from ..runtime.cpu_threads import share_torch_pool
    check_library(path)
    fn = runtime().load_module(str(path))[name]
    share_torch_pool(path)
    return fn


_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_PROGRAM_HEADER = struct.Struct("<IIQQQQQQ")


def check_library(path) -> None:
    """Refuse a file that is not a whole 64-bit little-endian ELF shared library: ``dlopen`` maps a
    truncated one and the process dies of SIGBUS when it touches the missing pages."""
    with open(path, "rb") as f:
        data = f.read()
    size = len(data)
    if size < _ELF_HEADER.size or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise CodegenError(f"{path} is not a 64-bit little-endian ELF library")
    (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = _ELF_HEADER.unpack_from(data)
    if phentsize != _PROGRAM_HEADER.size or phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
        raise CodegenError(f"{path} is truncated or malformed (ELF headers out of the file)")
    for i in range(phnum):
        _, _, offset, _, _, filesz, _, _ = _PROGRAM_HEADER.unpack_from(data, phoff + i * phentsize)
        if offset + filesz > size:
            raise CodegenError(f"{path} is truncated (a segment ends past the end of the file)")


def num_threads() -> int:
    return int(tvm().runtime.num_threads())


def _host_fingerprint() -> str:
    info = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features", "CPU part")):
                info += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        info += platform.processor()
    return hashlib.sha256(info.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def cpu_target_spec() -> dict:
    """The LLVM target of this host CPU as TVM's target dict (TVM 0.27 wants a dict, no 'native').

    LLVM's name for the host CPU is remembered per CPU model in the kernel cache, so a
    warm compile does not import the compiler to ask again.
    """
    from . import cache
    _set_threads()
    note = cache.cache_root() / "hosts" / f"{_host_fingerprint()}-{versions()['tvm']}.json"
    try:
        mcpu = json.loads(note.read_text())["mcpu"]
    except (OSError, ValueError, KeyError):
        tvm()
        from tvm.target import codegen
        mcpu = codegen.llvm_get_system_cpu()
        note.parent.mkdir(parents=True, exist_ok=True)
        tmp = note.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"mcpu": mcpu}))
        os.replace(tmp, note)
    return {"kind": "llvm", "mcpu": mcpu, "num-cores": int(os.environ["TVM_NUM_THREADS"])}


def cpu_target():
    return tvm().target.Target(cpu_target_spec())


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "?"
    return {"tvm": version("apache-tvm"), "tvm_ffi": version("apache-tvm-ffi")}
