"""Cache of propagation + transformation results, so an unchanged re-compile skips both.

The key hashes everything those passes read: the graph's structure (ops, their arguments
and attributes, inputs, outputs, aliases, tensor names, shapes, dtypes, kinds), every TeSA
after the user's TeSAs are attached, which tensors carry data and of what dtype, the *values*
of every non-floating-point tensor (index buffers, masks, position ids: propagation runs ops
on them, ``passes/scramble.py``), the target, the passes' options and the source of
``sparta.passes`` (rules and shipped hardware profiles). Floating-point weight values are not
part of it: propagation and planning read only their TeSAs (calibration, which reads them,
bypasses this cache; the kernels, which pack them, have their own). The entry holds every
propagated TeSA (compact encoding), the propagation report and the plan JSON, in one
file whose SHA-256 the kernel cache checks; a bad entry is recomputed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import types
from pathlib import Path

import torch

from .codegen import cache
from .graph import Graph
from .stacked_value import StackedValue
from .tesa import TeSA

_LEN = struct.Struct("<Q")
FILENAME = "pipeline.bin"


@functools.lru_cache(maxsize=None)
def _passes_digest() -> str:
    """Hash of the passes' source and shipped profiles: edited rules never hit a stale entry."""
    from . import passes
    h = hashlib.sha256()
    root = Path(passes.__file__).parent
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    h.update(Path(__file__).with_name("target.py").read_bytes())      # what a target lets the planner use
    return h.hexdigest()[:16]


def pipeline_key(graph: Graph, target: str, options: dict) -> str:
    """Content hash of what propagation and transformation depend on."""
    h = hashlib.sha256()
    h.update(json.dumps({"target": target, "options": options, "passes": _passes_digest(), "rules": _rules_digest(),
                         "inputs": graph.inputs,
                         "outputs": graph.outputs, "aliases": graph.meta.get("aliases", {})},
                        sort_keys=True, default=str).encode())
    for op in graph.ops():
        h.update(json.dumps([op.name, op.op, op.inputs, op.outputs, op.roles, str(op.target), op.attrs,
                             repr(op.args), repr(op.kwargs), op.multi_output], sort_keys=True, default=repr).encode())
    for v in graph.tensors():
        data = str(v.data.dtype) if v.has_data and not isinstance(v, StackedValue) else str(v.dtype) \
            if v.has_data else None             # (a stacked value: its parts' dtype, without concatenating them)
        h.update(f"{v.name}|{v.shape}|{v.dtype}|{v.kind}|{v.is_parameter}|{data}|{v.tesa.digest()}".encode())
        if v.has_data and not v.dtype.is_floating_point:
            h.update(value_bytes(v.data))
    return h.hexdigest()[:32]


def value_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor's values (what a key hashes)."""
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _rules_digest() -> str:
    """Hash of the rule table as registered now: a rule a user registers (or replaces) changes the key."""
    from .passes.rules import RULES
    h = hashlib.sha256()
    for op_type, fn in sorted(RULES.items()):
        code = getattr(fn, "__code__", None)
        h.update(f"{op_type}|{getattr(fn, '__module__', '')}|{getattr(fn, '__qualname__', repr(fn))}".encode())
        if code is not None:
            _hash_code(code, h)
    return h.hexdigest()[:16]


def _hash_code(code, h) -> None:
    """Bytecode and constants, nested functions' too (a code object's repr holds its address: not stable)."""
    h.update(code.co_code)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _hash_code(const, h)
        else:
            h.update(repr(const).encode())


def load(key: str):
    """(TeSAs by tensor name, propagation report JSON or None, plan JSON), or None on a miss.

    A corrupt or unreadable entry counts as a miss and is removed."""
    path = cache.lookup(key, FILENAME)
    if path is None:
        return None
    try:
        return _read(path)
    except Exception:  # noqa: BLE001 - any decoding failure: recompute
        cache.invalidate(key)
        return None


def store(key: str, graph: Graph, report: dict | None, plan: dict) -> None:
    cache.store(key, FILENAME, lambda p: _write(p, graph, report, plan), {"kind": "pipeline"})


def _read(path: Path):
    blob = path.read_bytes()
    (n,) = _LEN.unpack_from(blob)
    index = json.loads(blob[_LEN.size:_LEN.size + n])
    base = _LEN.size + n
    tesas = {name: TeSA.from_bytes(blob[base + off:base + off + size]) for name, (off, size) in index["tesas"].items()}
    return tesas, index.get("report"), index["plan"]


def _write(path: Path, graph: Graph, report: dict | None, plan: dict) -> None:
    chunks, index, off = [], {}, 0
    for v in graph.tensors():
        b = v.tesa.to_bytes()
        index[v.name] = (off, len(b))
        chunks.append(b)
        off += len(b)
    head = json.dumps({"tesas": index, "report": report, "plan": plan}).encode()
    path.write_bytes(_LEN.pack(len(head)) + head + b"".join(chunks))
