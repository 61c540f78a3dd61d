"""Build a PrimFunc for the CPU through TVM (LLVM), cached on disk, and load it."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import threading
import time
from dataclasses import dataclass

from ..errors import CodegenError
from . import cache
from .dismantle import eliminate_dead_code
from .tvm_env import cpu_target, cpu_target_spec, load_kernel, runtime, tvm, versions


# TVMScript parses a template's source with ``ast.parse``, and so does hashing a template's imports; CPython 3.11
# fails ("AST constructor recursion depth mismatch") when threads parse at once: every parse takes this lock (a CUDA
# build pool runs its templates one at a time, nvcc still in parallel)
_PARSE = threading.Lock()


@functools.lru_cache(maxsize=None)
def _source_digest(module) -> str:
    """Hash of a template module's source and of the package modules it imports (relative imports,
    also those inside functions, transitively): an edited template or macro never hits a stale entry."""
    digest = hashlib.sha256()
    with _PARSE:
        names = sorted(_relative_imports(module.__name__))
    for name in names:
        digest.update(inspect.getsource(importlib.import_module(name)).encode())
    return digest.hexdigest()[:16]


def _relative_imports(name: str, seen: set | None = None) -> set:
    seen = set() if seen is None else seen
    seen.add(name)
    module = importlib.import_module(name)
    package = module.__package__ or ""
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            targets = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                if target not in seen and importlib.util.find_spec(target) is not None:
                    _relative_imports(target, seen)
    return seen


@dataclass
class BuiltKernel:
    fn: object          # callable(*tvm/torch tensors)
    key: str
    cached: bool
    build_s: float
    nbytes: int         # size of the compiled library


_LOADED: dict[str, BuiltKernel] = {}  # this process's loaded kernels: shared kernels load once


def build_cpu(template, spec) -> BuiltKernel:
    """Compile ``template(spec)`` (a PrimFunc named ``spec.name``) unless cached; load it.

    The cache key covers the spec, the target, the TVM versions and the source of the
    template's module, so an edited template never hits a stale entry.
    """
    name = spec.name
    key = cache.cache_key({"template": f"{template.__module__}.{template.__name__}", "spec": spec.key(),
                           "target": cpu_target_spec(), "versions": versions(),
                           "source": _source_digest(inspect.getmodule(template))})
    t0 = time.perf_counter()
    if key in _LOADED and cache.lookup(key, "kernel.so") is not None:
        hit = _LOADED[key]
        return BuiltKernel(hit.fn, key, True, time.perf_counter() - t0, hit.nbytes)
    path = cache.lookup(key, "kernel.so")
    fn = None
    if path is not None:
        runtime()                 # no TVM runtime is an install problem, not a broken entry: raise, keep the entry
        try:
            fn = load_kernel(path, name)
        except Exception:  # noqa: BLE001 - an intact file TVM cannot load: rebuild it
            cache.invalidate(key)
    cached = fn is not None
    if fn is None:
        t = tvm()
        with _PARSE:
            func = template(spec)
        func = eliminate_dead_code(func)
        try:
            ex = t.compile(t.IRModule({name: func}), target=cpu_target())
        except Exception as exc:  # noqa: BLE001 - report which kernel failed
            raise CodegenError(f"TVM could not build kernel {name!r}: {exc}") from exc
        path = cache.store(key, "kernel.so", lambda p: ex.export_library(str(p)), {"name": name})
        fn = load_kernel(path, name)
    _LOADED[key] = BuiltKernel(fn, key, cached, time.perf_counter() - t0, path.stat().st_size)
    return _LOADED[key]
