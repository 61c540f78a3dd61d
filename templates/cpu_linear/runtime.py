"""The CPU kernel module: a planned GEMM-like op run through its sparta kernels (``templates/cpu_linear/``).

A :class:`SparseLinearCPU` holds, for each sub-operator of the op's plan, the compiled
TVM function and its packed arguments (only kept blocks / non-zeros). It is called with
the op's activation and returns the op's output; sub-operators after the first add into
the same output (the plan's ``reduction="sum"``). Tensors go to TVM zero-copy (DLPack).
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import importlib.util
import os
import sys

import torch

from ...backend.fx import Passthrough
from . import block_spec, fine_spec
from .block import block_linear
from .block_spec import quantize_rows
from .epilogue import ACTIVATIONS, torch_activation
from .fine import fine_linear
from ...errors import SpartaError
from ...runtime.ops import KernelModule


@functools.lru_cache(maxsize=1)
def reuse_freed_memory() -> bool:
    """Let glibc's malloc keep freed large blocks for reuse instead of returning them to the OS.

    By default every allocation over 32 MB (a 4096×3072 fp32 activation is 50 MB) is a
    fresh mmap, and touching it costs a page fault per 4 KB, more than a 90%-sparse FFN kernel
    takes. Serving the heap from brk with trimming raised makes repeat calls reuse warm pages,
    as jemalloc/tcmalloc do for CPU inference (measured: benchmarks/RESULTS.md, "CPU linear").
    Process-wide (torch ops benefit alike); ``SPARTA_KEEP_MALLOC=1`` opts out.
    """
    if os.environ.get("SPARTA_KEEP_MALLOC") == "1" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


class SubKernel:
    """One compiled sub-operator: function, template spec module (``block_spec`` or ``fine_spec``: packing and
    argument order), spec and packed arguments (``folder``: where its library lies when not in the kernel cache)."""

    def __init__(self, fn, template, spec, packed: dict[str, torch.Tensor], info: dict, folder=None):
        self.fn, self.template, self.spec, self.packed, self.info = fn, template, spec, packed, info
        self.folder = folder

    def __deepcopy__(self, memo):      # the compiled function is shared (immutable, and TVM's cannot be copied)
        return SubKernel(self.fn, self.template, self.spec, copy.deepcopy(self.packed, memo), dict(self.info),
                         self.folder)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, xq=None) -> None:
        args = dict(self.packed)
        if getattr(self.spec, "int8_activations", False):
            args["X"], args["XS"] = xq
        else:
            args["X"] = x
        args["Y"] = y
        if bias is not None:
            args["B"] = bias
        self.fn(*[args[a] for a in self.template.argument_names(self.spec)])


class SparseLinearCPU(KernelModule):
    """``y = act(x · Wᵀ + b)`` computed by sub-operator kernels over padded (N, K): the op ``sparta::cpu_linear``
    runs the kernels; padding, slicing, a bias the kernels do not add and an activation they do not fuse are torch
    ops around it."""

    native_kernels = True      # a saved one carries compiled libraries: sparta.load rebuilds them unless trusted
    kernel_family = "cpu_linear"

    def __init__(self, op_name: str, input_name: str, subs: list[SubKernel], n: int, k: int, n_pad: int,
                 k_pad: int, out_shape: tuple[int, ...], bias: torch.Tensor | None, fused_activation: str | None,
                 post_activation: str | None, extra_bias: torch.Tensor | None = None):
        super().__init__()
        reuse_freed_memory()
        self.op_name, self.input_names = op_name, [input_name]
        self.subs = subs
        self.n, self.k, self.n_pad, self.k_pad = n, k, n_pad, k_pad
        self.out_shape = tuple(out_shape)
        self.fused_activation, self.post_activation = fused_activation, post_activation
        for i, s in enumerate(subs):  # register packed tensors so .state_dict()/memory accounting see them
            for name, t in s.packed.items():
                self.register_buffer(f"sub{i}_{name}", t, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("extra_bias", extra_bias, persistent=False)
        self.weight_names = ("bias", *(f"sub{i}_{name}" for i, s in enumerate(subs) for name in s.packed))
        rows = {s.spec.m for s in subs}
        if len(rows) > 1:
            raise SpartaError(f"op {op_name!r}: sub-kernels built for different rows {sorted(rows)}")
        self.rows = rows.pop() if rows else 0          # 0: the kernels take any number of rows
        self.int8_activations = any(getattr(s.spec, "int8_activations", False) for s in subs)
        self.register_kernel(op_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.k)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if self.k_pad != self.k:
            x2 = torch.nn.functional.pad(x2, (0, self.k_pad - self.k))
        (y,) = self.call_kernel(x2.contiguous())
        out = y[:, : self.n] if self.n_pad != self.n else y
        if self.extra_bias is not None:
            out = out + self.extra_bias.reshape(-1, self.n) if self.extra_bias.dim() > 1 else out + self.extra_bias
        if self.post_activation is not None:
            out = torch_activation(self.post_activation, out)
        out = out.reshape(*x.shape[:-1], self.n)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._refresh_packed()
        return self

    def bind_weights(self, weights: list[torch.Tensor]) -> None:
        super().bind_weights(weights)
        self._refresh_packed()

    def _refresh_packed(self) -> None:
        """The sub-kernels read the module's buffers (after ``.to()`` or an op call that passed others)."""
        for i, sub in enumerate(self.subs):
            for name in sub.packed:
                sub.packed[name] = self._buffers[f"sub{i}_{name}"]

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sub-operators' kernels on the padded fp32 ``(M, K_pad)`` input: ``[(M, N_pad) fp32]``."""
        x2 = inputs[0].contiguous()
        if self.subs and self.rows and x2.shape[0] != self.rows:
            raise SpartaError(f"op {self.op_name!r}: its kernels were built for {self.rows} rows, called with "
                              f"{x2.shape[0]}")
        y = torch.empty(x2.shape[0], self.n_pad, dtype=torch.float32)
        bias = self.bias
        if not self.subs:
            y.zero_()
            if bias is not None:
                y[:, : self.n] += bias
        if bias is not None and self.n_pad != self.n:
            bias = torch.nn.functional.pad(bias, (0, self.n_pad - self.n))
        xq = quantize_rows(x2) if self.int8_activations else None
        for i, sub in enumerate(self.subs):
            sub(x2, y, bias if i == 0 and sub.spec.bias else None, xq)
        return [y]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [inputs[0].new_empty(inputs[0].shape[0], self.n_pad)]

    # ---- saved models (sparta.saved): the specs travel with the libraries ------------------
    def plan_tensors(self) -> set[str]:
        """What a kernels-only save keeps: the index tensors (block / column lists), not the values."""
        return {f"sub{i}_{name}" for i, s in enumerate(self.subs) for name in s.packed if name in _INDEX_ARGS}

    def baked_values(self) -> str | None:
        """Why the kernels hold weight values in their code (fine-grained, fully dismantled), or None."""
        if any(s.template is fine_spec and s.spec.values is not None for s in self.subs):
            return "a fine-grained sub-kernel dismantled fully bakes its weight values into its code"
        return None

    def repack(self, graph, op_plan) -> None:
        """Pack the graph's weight and bias again as the build does (``packing.pack_sub`` per sub-kernel)."""
        from ...passes.gemm import weight_matrix
        from .packing import effective_weight, op_bias, pack_sub
        if (why := self.baked_values()) is not None:
            raise SpartaError(f"op {self.op_name!r}: {why}; compile with dismantle='tile' to take other weights")
        op = graph.op(self.op_name)
        weight = weight_matrix(graph, op)
        if len(op_plan.subops) != len(self.subs):
            raise SpartaError(f"op {self.op_name!r}: the plan and the saved kernels disagree on the sub-operators")
        for i, (sub, s) in enumerate(zip(op_plan.subops, self.subs)):
            packed = pack_sub(op_plan, weight, sub, s.template, s.spec, self.n, self.k, self.n_pad, self.k_pad)
            if set(packed) != set(s.packed):
                raise SpartaError(f"op {self.op_name!r}: sub-kernel {i} packs {sorted(packed)}, not {sorted(s.packed)}")
            for name, t in packed.items():
                self._buffers[f"sub{i}_{name}"] = t
        self.bias, self.extra_bias = op_bias(graph, op, self.n)
        self._refresh_packed()
        self.reference_weight = effective_weight(graph, op, self.subs, self.n, self.k)

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict]:
        from ...codegen import cache
        from ...graph_json import encode
        subs, tensors, folders = [], {}, {}
        for i, s in enumerate(self.subs):
            subs.append({"template": saved_template_name(s.template), "spec": encode(dataclasses.asdict(s.spec)),
                         "info": s.info, "packed": sorted(s.packed)})
            tensors.update({f"sub{i}_{name}": t for name, t in s.packed.items()})
            folders[s.info["key"]] = s.folder or cache.cache_root() / s.info["key"]
        for name in ("bias", "extra_bias"):
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        config = {"op_name": self.op_name, "input_name": self.input_names[0], "n": self.n, "k": self.k,
                  "n_pad": self.n_pad, "k_pad": self.k_pad, "out_shape": list(self.out_shape),
                  "fused_activation": self.fused_activation, "post_activation": self.post_activation, "subs": subs}
        return config, tensors, folders

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict,
                   trust_kernels: bool = False) -> SparseLinearCPU:
        """Rebuild the sub-kernels from their saved specs through sparta's templates (the kernel cache
        has those this machine built); ``trust_kernels`` loads the saved libraries instead."""
        from ...codegen.build import build_cpu
        from ...codegen.tvm_env import load_kernel
        from ...graph_json import decode
        subs = []
        for i, sub in enumerate(config["subs"]):
            template, spec_cls, builder = SAVED_TEMPLATES[sub["template"]]
            spec = spec_cls(**decode(sub["spec"]))
            packed = {n: tensors[f"sub{i}_{n}"] for n in sub["packed"]}
            check_saved_sub(template, spec, packed, config)
            if trust_kernels:
                folder = folders[sub["info"]["key"]]
                subs.append(SubKernel(load_kernel(folder / "kernel.so", spec.name), template, spec, packed,
                                      sub["info"], folder))
            else:
                _need_tvm()
                built = build_cpu(builder, spec)
                subs.append(SubKernel(built.fn, template, spec, packed, {**sub["info"], "key": built.key}))
        return cls(config["op_name"], config["input_name"], subs, config["n"], config["k"], config["n_pad"],
                   config["k_pad"], tuple(config["out_shape"]), tensors.get("bias"), config["fused_activation"],
                   config["post_activation"], tensors.get("extra_bias"))

    def extra_repr(self) -> str:
        parts = ", ".join(f"{s.info['template']}[{s.info.get('blocks', '')}]" for s in self.subs)
        return f"{self.op_name}: {self.k}->{self.n}, subs=({parts}), act={self.fused_activation or self.post_activation}"


# saved template name -> (spec module, spec class, the template that builds it); the names are those of the modules
# the CPU templates were in when models were first saved
SAVED_TEMPLATES = {"cpu_linear": (block_spec, block_spec.BlockLinearSpec, block_linear),
                   "cpu_fine": (fine_spec, fine_spec.FineLinearSpec, fine_linear)}


def saved_template_name(template) -> str:
    """The name a save records for a sub-kernel's template spec module (``SAVED_TEMPLATES``)."""
    return next(name for name, (module, _, _) in SAVED_TEMPLATES.items() if module is template)


_INDEX_ARGS = ("C", "P", "I")     # block / column indices the kernels read at run time


def check_saved_sub(template, spec, packed: dict[str, torch.Tensor], config: dict) -> None:
    """Refuse a saved sub-kernel whose spec or packed tensors could make the kernel index outside
    its buffers: the spec's numbers must be in range, and the packed tensors must have the shapes
    and dtypes, and the index tensors the values, that packing this spec gives."""
    block = getattr(spec, "block", (1, 1))
    columns = spec.k // block[1] if all(type(b) is int and b > 0 for b in block) else 0
    values = getattr(spec, "values", None)
    ok = (type(spec.m) is int and spec.m >= 0 and all(type(v) is int and v > 0 for v in (spec.n, spec.k, *block))
          and columns > 0
          and isinstance(spec.name, str) and spec.name.isidentifier() and spec.activation in ACTIVATIONS
          and (spec.n, spec.k) == (config["n_pad"], config["k_pad"]) and isinstance(spec.rows, tuple)
          and all(isinstance(r, tuple) and all(type(j) is int and 0 <= j < columns for j in r) for r in spec.rows)
          and (values is None or (isinstance(values, tuple) and len(values) == len(spec.rows) and all(
              isinstance(v, tuple) and len(v) == len(r) and all(isinstance(x, float) for x in v)
              for v, r in zip(values, spec.rows)))))
    if not ok:
        raise ValueError(f"saved kernel spec {getattr(spec, 'name', '?')!r} is out of range or malformed")
    expected = template.pack(spec, torch.zeros(spec.n, spec.k))
    if set(packed) != set(expected):
        raise ValueError(f"saved kernel {spec.name!r}: packed tensors {sorted(packed)}, "
                         f"its spec packs {sorted(expected)}")
    for name, t in packed.items():
        e = expected[name]
        if t.shape != e.shape or t.dtype != e.dtype or (name in _INDEX_ARGS and not torch.equal(t, e)):
            raise ValueError(f"saved kernel {spec.name!r}: packed tensor {name} does not match its spec")


def _need_tvm() -> None:
    from ...errors import CodegenError
    try:
        present = importlib.util.find_spec("tvm") is not None
    except ImportError:
        present = False
    if not present:
        raise CodegenError("this saved CPU model's kernels are rebuilt from their specs, which needs TVM "
                           "(pip install apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1); "
                           "sparta.load(path, trust_kernels=True) loads the folder's compiled libraries instead, "
                           "native code to run only from a folder you trust")


def block_rows(grid: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(torch.nonzero(grid[i]).flatten().tolist()) for i in range(grid.shape[0]))


__all__ = ["SparseLinearCPU", "SubKernel", "Passthrough", "block_rows"]
