"""The execution plan: plain dataclasses that codegen consumes, tests pin, and JSON stores.

A :class:`Plan` holds one :class:`OpPlan` per graph op. An op either stays a torch op
(``kind="torch"``), runs the dense vendor GEMM (``"dense"``), or is split into sparta
sub-operators (``"sparse"``) whose outputs add into the one output (``reduction="sum"``):
``X·W = X·W_32x32_blocks + X·W_fine``. Every candidate considered is kept (name and
estimated µs) so the choice can be inspected. Unknown fields raise :class:`PlanError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...errors import PlanError
from ...tesa import TeSA

TEMPLATES = ("dense", "block_sparse", "fine_sparse")
KINDS = ("torch", "dense", "sparse")
DISMANTLE = ("none", "full", "tile")


@dataclass
class SubOp:
    """One sub-operator: a kernel template instantiated for one part of the weight."""

    template: str
    weight_bits: int
    act_bits: int
    block: tuple[int, int] | None
    n_blocks: int
    nnz: int
    est_us: float
    blocks: TeSA | None = None     # chosen block grid (1 = block computed)
    elements: TeSA | None = None   # the weight elements this sub-op computes, at weight_bits

    def __post_init__(self):
        if self.template not in TEMPLATES:
            raise PlanError(f"unknown kernel template {self.template!r}; expected one of {TEMPLATES}")
        if self.block is not None:
            self.block = tuple(int(b) for b in self.block)


@dataclass
class Candidate:
    name: str
    est_us: float
    description: str = ""


@dataclass
class OpPlan:
    """How one graph op runs."""

    op: str
    op_type: str
    kind: str
    est_us: float
    dense_us: float
    weight: str | None = None
    gemm: tuple[int, int, int] | None = None       # (M, N, K) of the op seen as a GEMM
    density: float = 1.0
    bits: dict[int, int] = field(default_factory=dict)
    subops: list[SubOp] = field(default_factory=list)
    reduction: str = "sum"
    epilogue: list[str] = field(default_factory=list)
    dismantle: str = "none"
    candidates: list[Candidate] = field(default_factory=list)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise PlanError(f"op {self.op!r}: unknown plan kind {self.kind!r}; expected one of {KINDS}")
        if self.dismantle not in DISMANTLE:
            raise PlanError(f"op {self.op!r}: unknown dismantle level {self.dismantle!r}")
        if self.gemm is not None:
            self.gemm = tuple(int(g) for g in self.gemm)

    def replace(self, **fields) -> OpPlan:
        """A copy with ``fields`` changed (pin a field in tests); unknown fields raise."""
        _check_fields(OpPlan, fields, f"op plan {self.op!r}")
        return dataclasses.replace(self, **fields)


@dataclass
class Plan:
    target: str
    profile: dict[str, Any]
    ops: dict[str, OpPlan] = field(default_factory=dict)

    def __getitem__(self, op_name: str) -> OpPlan:
        if op_name not in self.ops:
            raise PlanError(f"no plan for op {op_name!r}")
        return self.ops[op_name]

    def pin(self, op_name: str, **fields) -> None:
        """Override fields of one op's plan (unknown op or field names raise)."""
        self.ops[op_name] = self[op_name].replace(**fields)

    def est_us(self) -> float:
        return sum(p.est_us for p in self.ops.values())

    def dense_us(self) -> float:
        return sum(p.dense_us for p in self.ops.values())

    def report(self, only_gemm: bool = False) -> str:
        """A table: op, type, kind, density, bits, chosen blocks, estimated µs, dense µs."""
        from ...compiler import _table
        rows = [("op", "type", "kind", "density", "bits", "blocks", "est µs", "dense µs")]
        for p in self.ops.values():
            if only_gemm and p.gemm is None:
                continue
            blocks = " + ".join(f"{s.n_blocks}x{s.block[0]}x{s.block[1]}@W{s.weight_bits}A{s.act_bits}"
                                if s.block else f"dense@W{s.weight_bits}A{s.act_bits}" for s in p.subops)
            bits = " ".join(f"{b}:{c}" for b, c in sorted(p.bits.items())) if p.bits else ""
            rows.append((p.op, p.op_type, p.kind, f"{p.density:.3f}" if p.gemm else "", bits, blocks,
                         f"{p.est_us:.1f}", f"{p.dense_us:.1f}"))
        total = f"total: est {self.est_us():.1f} µs vs dense {self.dense_us():.1f} µs on {self.target} " \
                f"({self.profile.get('device', '')})"
        return _table(rows) + "\n" + total

    # ---- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"target": self.target, "profile": self.profile,
                "ops": {name: _op_to_json(p) for name, p in self.ops.items()}}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        _check_fields(Plan, data, "plan")
        try:
            ops = {name: _op_from_json(d) for name, d in data.get("ops", {}).items()}
            return cls(data["target"], dict(data["profile"]), ops)
        except KeyError as exc:
            raise PlanError(f"plan JSON lacks field {exc}") from exc


def _check_fields(cls, fields: dict, what: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise PlanError(f"{what}: unknown field(s) {unknown}; known: {sorted(known)}")


def _sub_to_json(s: SubOp) -> dict:
    d = dataclasses.asdict(s)
    d["blocks"] = s.blocks.to_json() if s.blocks is not None else None
    d["elements"] = s.elements.to_json() if s.elements is not None else None
    return d


def _op_to_json(p: OpPlan) -> dict:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(OpPlan)}
    d["subops"] = [_sub_to_json(s) for s in p.subops]
    d["candidates"] = [dataclasses.asdict(c) for c in p.candidates]
    d["bits"] = {str(k): v for k, v in p.bits.items()}
    d["gemm"] = list(p.gemm) if p.gemm else None
    return d


def _op_from_json(d: dict) -> OpPlan:
    _check_fields(OpPlan, d, f"op plan {d.get('op', '?')!r}")
    subs = []
    for s in d.get("subops", []):
        _check_fields(SubOp, s, "sub-operator")
        s = dict(s)
        s["blocks"] = TeSA.from_json(s["blocks"]) if s.get("blocks") else None
        s["elements"] = TeSA.from_json(s["elements"]) if s.get("elements") else None
        subs.append(SubOp(**s))
    cands = []
    for c in d.get("candidates", []):
        _check_fields(Candidate, c, "candidate")
        cands.append(Candidate(**c))
    fields = {**d, "subops": subs, "candidates": cands, "bits": {int(k): v for k, v in d.get("bits", {}).items()}}
    return OpPlan(**fields)
