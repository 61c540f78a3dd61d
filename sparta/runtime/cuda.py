"""Launch sparta's CUDA kernels from torch without TVM: cuda-bindings' driver API.

A kernel folder (``launch.json`` + ``kernel.<arch>.cubin``, see ``sparta.codegen.cuda_build``)
is loaded into the current device's primary context, which torch has made current,
and launched on torch's current stream, so it orders with torch's work and can be
captured in a CUDA graph. Errors say what is wrong: no GPU, no cubin for this
architecture, a cubin that fails to load, wrong argument shapes or dtypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from pathlib import Path

import torch

from ..errors import SpartaError


class CudaRuntimeError(SpartaError):
    """A CUDA kernel could not be loaded or launched."""


_DTYPES = {"float16": torch.float16, "float32": torch.float32, "int8": torch.int8, "int32": torch.int32,
           "int64": torch.int64, "uint8": torch.uint8, "bfloat16": torch.bfloat16}


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaRuntimeError("running CUDA kernels needs cuda-bindings: pip install cuda-bindings") from exc
    return driver


def _check(result, what: str):
    driver = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise CudaRuntimeError(f"{what}: {err.name if hasattr(err, 'name') else err} "
                               f"({msg.decode() if isinstance(msg, bytes) else msg})")
    return rest[0] if len(rest) == 1 else rest


def check_fp16_input(name: str, x: torch.Tensor, m: int, k: int, dtype: torch.dtype = torch.float16) -> None:
    """Refuse ``x`` unless it is a contiguous ``dtype`` (fp16 or bf16) ``(m, k)`` tensor (what every sparta kernel
    reads; ``m=0``: any number of rows)."""
    if x.dim() != 2 or x.shape[1] != k or (m and x.shape[0] != m) or x.dtype != dtype or not x.is_contiguous():
        raise CudaRuntimeError(f"{name}: input must be a contiguous {'bf16' if dtype == torch.bfloat16 else 'fp16'} "
                               f"({m or 'M'}, {k}) tensor, "
                               f"got {x.dtype} {tuple(x.shape)}")


def check_saved_spec(op_name: str, folder, spec, load=None) -> None:
    """Refuse a saved op whose kernel folder records (``spec.json``) another spec than the op's.
    ``load(folder)`` reads the folder's spec (default: ``type(spec)`` from the JSON fields)."""
    path = Path(folder) / "spec.json"
    if not path.is_file():
        return
    built = load(folder) if load is not None else type(spec)(**json.loads(kernel_file(folder, "spec.json")))
    if built != spec:
        raise CudaRuntimeError(f"op {op_name!r}: kernel folder {Path(folder).name} was built for a different spec")


def act16_dtype(spec) -> torch.dtype:
    """The torch dtype of a kernel spec's 16-bit activations: bf16 where ``spec.act16`` (or its ``dtype``) says so."""
    act = getattr(spec, "act16", None) or getattr(spec, "dtype", "")
    return torch.bfloat16 if act == "bfloat16" else torch.float16


def lanes16(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit activation tensor as the fp16 lanes the kernels declare (bf16 viewed bit for bit; others as given)."""
    return t.view(torch.float16) if t.dtype == torch.bfloat16 else t


def device_arch(device=None) -> str:
    if not torch.cuda.is_available():
        raise CudaRuntimeError("no CUDA GPU is available (torch.cuda.is_available() is False)")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class GraphWeightLayout:
    """For graph modules standing for a weight: ``graph_weight()`` is their ``dense_weight()`` (N, K) in the
    graph weight's layout (``(K, N)`` for addmm/mm/matmul, ``weight_transposed``)."""

    def graph_weight(self) -> torch.Tensor:
        w = self.dense_weight()
        return w.t().contiguous() if self.weight_transposed else w


def check_launch(folder) -> dict:
    """``launch.json`` of a kernel folder, refused unless every field has the type and range the runtime
    needs and every cubin it names is a plain file inside the folder."""
    folder = Path(folder)
    try:
        launch = json.loads(kernel_file(folder, "launch.json"))
    except (OSError, ValueError) as exc:
        raise CudaRuntimeError(f"no readable launch.json in {folder}: {exc}") from exc

    def ints(v, n, low):
        return isinstance(v, list) and len(v) == n and all(type(x) is int and x >= low for x in v)

    args = launch.get("args") if isinstance(launch, dict) else None
    cubins = launch.get("cubins") if isinstance(launch, dict) else None
    shared = launch.get("shared_bytes", 0) if isinstance(launch, dict) else None
    sizes = {a.get("name") for a in args if isinstance(a, dict) and a.get("scalar") is True} \
        if isinstance(args, list) else set()

    def extent(e):       # an int, or [size, t]: ceil(size / t) over a scalar size argument
        return type(e) is int and e >= 1 or (isinstance(e, list) and len(e) == 2 and e[0] in sizes
                                             and type(e[1]) is int and e[1] >= 1)

    def arg_ok(a):
        if not isinstance(a, dict) or not isinstance(a.get("name"), str) or a.get("dtype") not in _DTYPES:
            return False
        if a.get("scalar") is True:
            return a["dtype"] == "int32"
        return isinstance(a.get("shape"), list) and all(
            e is None or e in sizes or type(e) is int and e >= 0 for e in a["shape"])

    ok = (isinstance(args, list) and isinstance(cubins, dict) and isinstance(launch.get("name"), str)
          and isinstance(launch.get("entry"), str) and isinstance(launch.get("grid"), list)
          and len(launch["grid"]) == 3 and all(extent(e) for e in launch["grid"])
          and ints(launch.get("block"), 3, 1) and type(shared) is int and shared >= 0
          and all(arg_ok(a) for a in args)
          and all(isinstance(c, dict) and isinstance(c.get("sha256"), str) for c in cubins.values()))
    if not ok:
        raise CudaRuntimeError(f"malformed launch.json in {folder}")
    for info in cubins.values():
        _plain_name(folder, info.get("file"))
    return launch


def _plain_name(folder: Path, name) -> Path:
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CudaRuntimeError(f"kernel folder {folder} names a file outside itself: {name!r}")
    return folder / name


def kernel_file(folder, name: str) -> bytes:
    """The bytes of the file ``name`` directly inside ``folder`` (no paths, no symbolic links)."""
    path = _plain_name(Path(folder), name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise CudaRuntimeError(f"cannot read {path} (a missing file or a symbolic link): {exc}") from exc
    with os.fdopen(fd, "rb") as f:
        return f.read()


class CudaKernel:
    """One compiled kernel, loaded lazily per device; call it with torch CUDA tensors."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.launch = check_launch(self.folder)
        self.name = self.launch["name"]
        self.tensor_args = [a for a in self.launch["args"] if not a.get("scalar")]
        self.sizes = [a["name"] for a in self.launch["args"] if a.get("scalar")]   # e.g. M: any number of rows
        self._functions = {}

    def _function(self, device: int):
        if device in self._functions:
            return self._functions[device]
        arch = device_arch(device)
        cubins = self.launch.get("cubins", {})
        info = cubins.get(arch) or cubins.get(arch + "a")     # sm_90a cubins run on sm_90 only
        if info is None:
            raise CudaRuntimeError(f"kernel {self.name!r} has no cubin for {arch} "
                                   f"(built for {sorted(self.launch.get('cubins', {}))})")
        blob = kernel_file(self.folder, info["file"])
        if hashlib.sha256(blob).hexdigest() != info["sha256"]:
            raise CudaRuntimeError(f"kernel {self.name!r}: {info['file']} does not match its recorded SHA-256")
        driver = _driver()
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(1, device=f"cuda:{device}")  # torch makes the primary context current
            module = _check(driver.cuModuleLoadData(blob), f"loading {info['file']} of {self.name!r}")
            fn = _check(driver.cuModuleGetFunction(module, self.launch["entry"].encode()),
                        f"finding {self.launch['entry']!r}")
            shared = int(self.launch.get("shared_bytes", 0))
            if shared > 48 * 1024:
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(driver.cuFuncSetAttribute(fn, attr, shared), "raising the shared-memory limit")
        self._functions[device] = (module, fn)
        return self._functions[device]

    def __call__(self, *tensors: torch.Tensor) -> None:
        self._checked(tensors).launch()

    def call(self, **tensors: torch.Tensor) -> None:
        """Launch with tensors given by argument name; names the kernel does not take are ignored
        (a constant table baked in, a bias the kernel was built without)."""
        self(*self._ordered(tensors))

    def prepare(self, per_call: tuple[str, ...] = (), **tensors: torch.Tensor) -> PreparedLaunch:
        """Check every argument once and launch; the result launches again with the ``per_call`` tensors swapped
        (it holds only the others: under CUDA graphs a tensor of one call must not outlive it)."""
        prepared = self._checked(self._ordered(tensors))
        prepared.launch()
        for name in per_call:
            prepared.keep[prepared.index[name]] = None
        return prepared

    def _ordered(self, tensors: dict) -> list:
        missing = [a["name"] for a in self.tensor_args if a["name"] not in tensors]
        if missing:
            raise CudaRuntimeError(f"kernel {self.name!r}: missing arguments {missing}")
        return [tensors[a["name"]] for a in self.tensor_args]

    def _checked(self, tensors) -> PreparedLaunch:
        specs = self.tensor_args
        if len(tensors) != len(specs):
            raise CudaRuntimeError(f"kernel {self.name!r} takes {len(specs)} tensors "
                                   f"({', '.join(a['name'] for a in specs)}), got {len(tensors)}")
        device = None
        for t, a in zip(tensors, specs):
            if not isinstance(t, torch.Tensor) or not t.is_cuda:
                raise CudaRuntimeError(f"kernel {self.name!r}: argument {a['name']} must be a CUDA tensor")
            shape_ok = t.dim() == len(a["shape"]) and all(type(e) is not int or e == d
                                                          for e, d in zip(a["shape"], t.shape))
            if t.dtype != _DTYPES[a["dtype"]] or not shape_ok or not t.is_contiguous():
                raise CudaRuntimeError(f"kernel {self.name!r}: argument {a['name']} must be a contiguous "
                                       f"{a['dtype']} tensor of shape {a['shape']}, got {t.dtype} "
                                       f"{list(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
            device = t.device.index if device is None else device
            if t.device.index != device:
                raise CudaRuntimeError(f"kernel {self.name!r}: all tensors must be on one device")
        _, fn = self._function(device)
        prepared = PreparedLaunch(self, fn, list(tensors))
        prepared.bind_sizes()
        return prepared

    def bound_sizes(self, shapes: list) -> dict[str, int]:
        """The size arguments (``M``) the tensors' shapes give, refused unless every tensor agrees."""
        sizes = {}
        for shape, a in zip(shapes, self.tensor_args):
            for e, d in zip(a["shape"], shape):
                if isinstance(e, str) and sizes.setdefault(e, d) != d:
                    raise CudaRuntimeError(f"kernel {self.name!r}: argument {a['name']} has {e}={d}, another "
                                           f"argument {e}={sizes[e]}")
        return sizes


class PreparedLaunch:
    """A launch whose arguments were checked once: ``launch(X=x, Y=y)`` swaps same-shaped
    tensors in and launches on the current stream with a few µs of host work."""

    def __init__(self, kernel: CudaKernel, fn, tensors: list):
        self.kernel, self.fn = kernel, fn
        names = [a["name"] for a in kernel.tensor_args]
        self.index = {n: i for i, n in enumerate(names)}
        self.meta = {n: ([e if e is None or isinstance(e, str) else d for e, d in zip(a["shape"], t.shape)], t.dtype)
                     for n, t, a in zip(names, tensors, kernel.tensor_args)}   # sizes (M) and free dims stay free
        self.shapes = [t.shape for t in tensors]
        self.keep = tensors     # keeps the fixed tensors (weights, tables) alive; per-call ones go at the next launch
        self.device = tensors[0].device.index
        self.values = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
        self.size_values = {n: ctypes.c_int32(0) for n in kernel.sizes}
        slots = {a["name"]: (self.size_values[a["name"]] if a.get("scalar") else self.values[self.index[a["name"]]])
                 for a in kernel.launch["args"]}
        self.params = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(slots[a["name"]])
                                                         for a in kernel.launch["args"]])
        self.grid_spec, self.block = kernel.launch["grid"], kernel.launch["block"]
        self.grid = [e if type(e) is int else 1 for e in self.grid_spec]
        self.shared = int(kernel.launch.get("shared_bytes", 0))
        self.driver = _driver()
        self.config = None
        if kernel.launch.get("pdl") and torch.cuda.get_device_capability(self.device) >= (9, 0):
            self.config = self._pdl_config()

    def bind_sizes(self) -> None:
        """Set the size arguments and the grid from the bound tensors' shapes (a kernel for any number of rows)."""
        if not self.size_values:
            return
        sizes = self.kernel.bound_sizes(self.shapes)
        for name, value in self.size_values.items():
            value.value = sizes[name]
        self.grid = [e if type(e) is int else -(-sizes[e[0]] // e[1]) for e in self.grid_spec]
        if self.config is not None:
            self.config.gridDimX, self.config.gridDimY, self.config.gridDimZ = self.grid

    def _pdl_config(self):
        """A launch configuration with programmatic stream serialisation: the kernel may start while the previous
        one in the stream finishes (its ``griddepcontrol.wait`` holds it before it reads what that one wrote)."""
        d = self.driver
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = d.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = self.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = self.block
        config.sharedMemBytes = self.shared
        config.attrs, config.numAttrs = [attr], 1
        return config

    def launch(self, **tensors: torch.Tensor) -> None:
        for name, t in tensors.items():
            i = self.index[name]
            shape, dtype = self.meta[name]
            if t.dtype != dtype or not t.is_cuda or t.device.index != self.device or not t.is_contiguous() \
                    or t.dim() != len(shape) or any(type(e) is int and e != d for e, d in zip(shape, t.shape)):
                raise CudaRuntimeError(f"kernel {self.kernel.name!r}: argument {name} must be a contiguous "
                                       f"{dtype} CUDA tensor of shape {list(shape)} on cuda:{self.device}, got "
                                       f"{t.dtype} {list(t.shape)}")
            self.keep[i] = None     # a per-call tensor: the caller holds it while the launch is queued
            self.values[i].value = t.data_ptr()
            self.shapes[i] = t.shape
        if self.size_values:
            self.bind_sizes()
            if 0 in self.grid:      # no rows: nothing to compute
                return
        stream = self.driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        if self.config is not None:
            self.config.hStream = stream
            _check(self.driver.cuLaunchKernelEx(self.config, self.fn, ctypes.addressof(self.params), 0),
                   f"launching {self.kernel.name!r}")
            return
        _check(self.driver.cuLaunchKernel(self.fn, *self.grid, *self.block, self.shared, stream,
                                          ctypes.addressof(self.params), 0), f"launching {self.kernel.name!r}")
