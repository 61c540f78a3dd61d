"""Import TVM lazily, with its CPU thread pool sized to this machine."""

from __future__ import annotations

import functools
import os

from ..errors import CodegenError


@functools.lru_cache(maxsize=1)
def tvm():
    """The ``tvm`` module; TVM_NUM_THREADS defaults to the usable cores (TVM picks 1 on small VMs)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("TVM_NUM_THREADS", str(cores))
    try:
        import tvm as _tvm
    except ImportError as exc:  # pragma: no cover - TVM is a dependency; a GPU-only box may lack it
        raise CodegenError("compiling kernels needs TVM: pip install apache-tvm==0.27.0.post1 "
                           "apache-tvm-ffi==0.1.14.post1") from exc
    return _tvm


def num_threads() -> int:
    return int(tvm().runtime.num_threads())


def cpu_target():
    """The LLVM target of this host CPU (TVM 0.27 wants a dict, and no 'native')."""
    t = tvm()
    from tvm.target import codegen
    return t.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(),
                            "num-cores": int(os.environ["TVM_NUM_THREADS"])})


def versions() -> dict:
    t = tvm()
    import tvm_ffi
    return {"tvm": t.__version__, "tvm_ffi": getattr(tvm_ffi, "__version__", "?")}
