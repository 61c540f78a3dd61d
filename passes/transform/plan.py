"""The execution plan: plain dataclasses that codegen consumes, tests pin, and JSON stores.

A :class:`Plan` holds one :class:`OpPlan` per graph op. An op either stays a torch op
(``kind="torch"``), runs the dense vendor GEMM (``"dense"``), or is split into sparta
sub-operators (``"sparse"``) whose outputs add into the one output (``reduction="sum"``):
``X·W = X·W_32x32_blocks + X·W_fine``. Every candidate considered is kept (name and
estimated µs) so the choice can be inspected. Unknown fields raise :class:`PlanError`.
"""

from __future__ import annotations

import base64
import dataclasses
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from ...errors import PlanError
from ...formats import default_format, get_format
from ...tesa import TeSA
from ..quant.scheme import GRANULARITIES, QUANT_SOURCES, WeightQuant  # noqa: F401  (part of the plan)

TEMPLATES = ("dense", "block_sparse", "fine_sparse", "nm_sparse")   # nm_sparse: 2 of every 4 along K (CUDA)
KINDS = ("torch", "dense", "sparse", "shrink")
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
    weight_format: str = ""        # number format of the weights (sparta.formats; "": the default of weight_bits)
    act_format: str = ""           # number format of the activations ("": the default of act_bits)

    def __post_init__(self):
        if self.template not in TEMPLATES:
            raise PlanError(f"unknown kernel template {self.template!r}; expected one of {TEMPLATES}")
        self.weight_format = get_format(self.weight_format or default_format(self.weight_bits)).name
        self.act_format = get_format(self.act_format or default_format(self.act_bits)).name
        if self.block is not None:
            self.block = tuple(int(b) for b in self.block)

    def describe(self) -> str:
        """``32x32x32@W8A8``, ``dense@W16A16``, the formats in brackets where not the default of the bits
        (``[fp8_e4m3]``, ``[int4×bf16]``)."""
        where = "2:4" if self.template == "nm_sparse" else \
            f"{self.n_blocks}x{self.block[0]}x{self.block[1]}" if self.block else "dense"
        text = f"{where}@W{self.weight_bits}A{self.act_bits}"
        if (self.weight_format, self.act_format) == (default_format(self.weight_bits), default_format(self.act_bits)):
            return text
        same = self.weight_format == self.act_format
        return text + (f"[{self.weight_format}]" if same else f"[{self.weight_format}×{self.act_format}]")


@dataclass
class KernelChoice:
    """Which kernel runs an op, chosen by a target's selection table (``codegen/select_<target>.py``)."""

    kernel: str                    # a kernel family ("bsr_linear", "w4a16_gemv", "w8a8_gemv") or "torch"
    rule: str                      # the selection rule that chose it
    reason: str                    # why, in words (for "torch": why no sparta kernel runs it)
    dtype: str = "float16"         # what the kernel computes in ("float16", "int8", "w4a16")
    tiles: dict = field(default_factory=dict)      # the template's tiling parameters
    hopper: dict | None = None     # tiling of the sm_90 twin over the same packed weights (wgmma), if any
    note: str = ""                 # what the plan asked for that this kernel does not run, and why
    gemv: dict | None = None       # the few-row GEMV over the same packed weights, run for calls of <= gemv["rows"]
    buckets: list | None = None    # [[max rows, tiles], ...]: tile kernels over the same packed weights, each run for
    #                                calls of up to its rows (a graph of any rows; ``tiles`` runs above the last)
    few_rows: list | None = None   # [[max rows, family, tiles], ...]: low-bit GEMVs (their own packed weight) run
    #                                first, each for calls of up to its rows (a graph of any rows)
    dense_grid: bool = False       # a dense tile: every block computed, zeros included (no empty block skipped)
    bucket_us: list | None = None  # [[max rows, kernel, rows costed at, est µs, dense µs], ...] per entry of by_rows(),
    #                                from the cost of the kernel that runs there (est None: the profile has no cost)
    dense_from: int | None = None  # calls of at least this many rows run the vendor dense GEMM over a dense copy
    dequant: bool = False          # dense_from: of the weight dequantised from the packed codes at each call (no copy)

    def describe(self, epilogue: str = "") -> str:
        """The kernel (``epilogue``: what it fuses, e.g. `` +bias+relu``), per bucket of rows with its estimate."""
        if self.kernel == "torch":
            return f"torch ({self.reason})"
        tile = "x".join(str(self.tiles[k]) for k in ("tm", "bn", "bk") if k in self.tiles)
        main = f"{self.kernel}[{self.dtype}{' ' + tile if tile else ''}{' +wgmma' if self.hopper else ''}]{epilogue}"
        if not (self.gemv or self.buckets or self.few_rows or self.dense_from):
            return main
        rows = self.by_rows()               # the kernel per bucket of rows, per call, and its estimate
        costs = self.bucket_us if self.bucket_us and len(self.bucket_us) == len(rows) else [None] * len(rows)
        last = self.dense_label if self.dense_from else main
        return "; ".join([f"M<={top}: {kernel}{_cost(c)}" for (top, kernel), c in zip(rows[:-1], costs)]
                         + [f"else {last}{_cost(costs[-1], True)}"])

    def by_rows(self) -> list[tuple[int | None, str]]:
        """[(max rows, kernel), ...]: the kernel a call of up to that many rows runs, in increasing rows (None: the
        rest)."""
        return [(top, label) for top, label, _, _ in self.runs_by_rows()]

    def runs_by_rows(self) -> list[tuple[int | None, str, str, dict]]:
        """[(max rows, kernel, what runs, its tiling), ...] as :meth:`by_rows`; what runs: ``"bsr_gemv"``, a low-bit
        GEMV family, ``"tile"`` (a bucket's M tile over the main kernel's blocks) or the main kernel's family."""
        if self.kernel == "torch":
            return [(None, "torch", "torch", {})]
        out = [(top, f"{family}[{t.get('warps', '')} warps]", family, t) for top, family, t in self.few_rows or ()]
        if self.gemv and not self.few_rows:
            if one := self.gemv.get("one_row"):
                tiling = {k: v for k, v in self.gemv.items() if k != "one_row"} | one | {"rows": 1}
                out.append((1, f"bsr_gemv[1 row, {one['warps']} warps]", "bsr_gemv", tiling))
            out.append((self.gemv["rows"], f"bsr_gemv[{self.gemv['warps']} warps]", "bsr_gemv", self.gemv))
        low = max([t for t, *_ in out], default=0)
        out += [(top, f"tm {t['tm']}", "tile", t) for top, t in self.buckets or () if top > low]
        tile = "x".join(str(self.tiles[k]) for k in ("tm", "bn", "bk") if k in self.tiles)
        main = (None, f"{self.kernel}[{self.dtype}{' ' + tile if tile else ''}]", self.kernel, self.tiles)
        if self.dense_from is None:
            return out + [main]
        below = [r for r in out if r[0] < self.dense_from]         # what runs just below dense_from: the next one
        if not below or below[-1][0] < self.dense_from - 1:
            below.append((self.dense_from - 1, *(out[len(below):] + [main])[0][1:]))
        return below + [(None, self.dense_label, "dense", {})]

    @property
    def dense_label(self) -> str:
        """What runs the calls of ``dense_from`` rows or more."""
        return "cuBLAS[dequantised per call]" if self.dequant else "cuBLAS[dense copy]"

    def estimate_note(self) -> str:
        """Which kernels of the buckets of rows have no estimate, and why."""
        missing = list(dict.fromkeys(k.split("[")[0] for _, k, _, e, _ in self.bucket_us or () if e is None))
        return f"no estimate for {', '.join(missing)}: the cost profile has no cost for it" if missing else ""

    def kernel_at(self, rows: int) -> str:
        """The kernel a call of ``rows`` rows runs."""
        return next(k for top, k in self.by_rows() if top is None or rows <= top)


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
    weight_quant: dict[int, WeightQuant] = field(default_factory=dict)   # integer width -> how its scales are fitted
    note: str = ""                                 # what the plan could not honour, and why
    kernel: KernelChoice | None = None             # the kernel selection chose (sparse ops; see codegen/select_*)
    rows_us: list = field(default_factory=list)    # [[rows, est µs, dense µs], ...] over the token range planned for
    dense_from: tuple | None = None                # (rows the kernels win at, rows the dense GEMM wins from on)
    shrink: dict = field(default_factory=dict)     # kind "shrink": the channels kept ("out"/"in": [before, after],
    #                                                packed "out_keep"/"in_keep", "gather", "groups"; see shrink.py)

    def kept(self, n: int, k: int):
        """The (N, K) weight elements the sub-operators compute (bool)."""
        import torch
        keep = torch.zeros(n, k, dtype=torch.bool)
        for s in self.subops:
            keep |= s.elements.mask.reshape(n, k) if s.elements is not None else True
        return keep

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


GROUP_KINDS = ("epilogue", "norm", "codes")


@dataclass
class FusionGroup:
    """Ops one kernel computes: ``anchor``'s kernel also computes ``ops`` and/or hands ``readers`` the int8 codes of
    ``tensor`` (at the static ``scale``, or per token where None)."""

    kind: str
    anchor: str
    ops: list[str] = field(default_factory=list)
    tensor: str = ""
    readers: list[str] = field(default_factory=list)
    scale: float | None = None
    out: str = ""                  # norm: what it writes, "fp16" | "int8" | "both"
    tiles: dict = field(default_factory=dict)   # codes: the code-writing kernel's tiling where it differs

    def __post_init__(self):
        if self.kind not in GROUP_KINDS:
            raise PlanError(f"fusion group of {self.anchor!r}: unknown kind {self.kind!r}; expected one of "
                            f"{GROUP_KINDS}")

    def describe(self) -> str:
        if self.kind == "epilogue":
            return f"{self.anchor} computes {', '.join(self.ops)} in its epilogue"
        parts = [f"adds the residual ({', '.join(self.ops)})"] if self.ops else []
        if self.readers:
            at = f"at static scale {self.scale:.3g}" if self.scale is not None else "per token"
            sched = " (ping-pong kernel)" if self.tiles.get("pingpong") else ""
            parts.append(f"writes int8 codes of {self.tensor} {at} for {', '.join(self.readers)}{sched}")
        return f"{self.anchor} " + "; ".join(parts or ["runs sparta's kernel"])

    def to_json(self) -> dict:
        return dict(self.__dict__)



@dataclass
class Plan:
    target: str
    profile: dict[str, Any]
    ops: dict[str, OpPlan] = field(default_factory=dict)
    static_scales: dict[str, float] = field(default_factory=dict)   # int8 activations at one calibrated scale
    fusions: list = field(default_factory=list)    # FusionGroups: what each kernel computes of its neighbours
    channels: dict[str, str] = field(default_factory=dict)   # narrow tensors: their kept channels (packed bits)
    derived: dict[str, str] = field(default_factory=dict)    # constants computed from weights (folded, shrunk): how
    decode: dict[str, KernelChoice] = field(default_factory=dict)   # kernels only generate()'s decode steps run

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
        """A table: op, type, kind, density, bits, chosen blocks (with their number formats in brackets where
        not int4/int8/fp16/fp32), the kernel that runs them (with its fused epilogue), estimated µs, dense µs, and
        notes: why that kernel, and what the plan could not honour."""
        from ...text import table
        rows = [("op", "type", "kind", "density", "bits", "blocks", "kernel", "est µs", "dense µs", "note")]
        for p in self.ops.values():
            if only_gemm and p.gemm is None:
                continue
            blocks = _shrunk(p) if p.shrink else " + ".join(s.describe() for s in p.subops)
            bits = " ".join(f"{b}:{c}" for b, c in sorted(p.bits.items())) if p.bits else ""
            fused = " +" + "+".join(p.epilogue) if p.kind == "sparse" and p.epilogue else ""
            vendor = p.kind in ("dense", "shrink")
            kernel = p.kernel.describe(fused) if p.kernel is not None else ("vendor" if vendor else
                                                                            _cpu_kernels(p) + fused if p.kind == "sparse"
                                                                            else "")
            why = p.kernel.reason if p.kernel is not None and p.kernel.kernel != "torch" else ""
            kernel_notes = (p.kernel.note, p.kernel.estimate_note()) if p.kernel is not None else ()
            note = "; ".join(x for x in (p.note, why, *kernel_notes, _range(p)) if x)
            rows.append((p.op, p.op_type, p.kind, f"{p.density:.3f}" if p.gemm else "", bits, blocks, kernel,
                         f"{p.est_us:.1f}", f"{p.dense_us:.1f}", note))
        total = f"total: est {self.est_us():.1f} µs vs dense {self.dense_us():.1f} µs on {self.target} " \
                f"(profile: {self.profile.get('device', '')}, {self.profile.get('date', '')})"
        fusions = "".join(f"\nfusion ({g.kind}): {g.describe()}" for g in self.fusions)
        decode = "".join(f"\ngenerate() decode steps: {what} on {c.kernel}[{c.dtype} "
                         f"{'x'.join(str(c.tiles[k]) for k in ('hq', 'hkv', 'd'))}] ({c.reason})"
                         for what, c in self.decode.items())
        return table(rows) + "\n" + total + fusions + decode

    # ---- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"target": self.target, "profile": self.profile,
                "ops": {name: _op_to_json(p) for name, p in self.ops.items()},
                "static_scales": dict(self.static_scales), "fusions": [g.to_json() for g in self.fusions],
                "channels": dict(self.channels), "derived": dict(self.derived),
                "decode": {what: dataclasses.asdict(c) for what, c in self.decode.items()}}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        _check_fields(Plan, data, "plan")
        try:
            ops = {name: _op_from_json(d) for name, d in data.get("ops", {}).items()}
            scales = {str(t): float(s) for t, s in data.get("static_scales", {}).items()}
            fusions = []
            for g in data.get("fusions", []):
                _check_fields(FusionGroup, g, "fusion group")
                fusions.append(FusionGroup(**g))
            decode = {}
            for what, c in data.get("decode", {}).items():
                _check_fields(KernelChoice, c, "decode kernel")
                decode[str(what)] = KernelChoice(**c)
            return cls(data["target"], dict(data["profile"]), ops, scales, fusions,
                       {str(k): str(v) for k, v in data.get("channels", {}).items()},
                       {str(k): str(v) for k, v in data.get("derived", {}).items()}, decode)
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


def _cost(entry, last: bool = False) -> str:
    """`` ~X µs (dense Y µs)`` of one bucket's ``[max rows, kernel, rows, est µs, dense µs]`` (the last: at its
    rows)."""
    if entry is None:
        return ""
    _, _, rows, est, dense = entry
    at = f" at M={rows}" if last else ""
    return (f" ~{est:.1f} µs{at}" if est is not None else f" no estimate{at}") + f" (dense {dense:.1f} µs)"


def _shrunk(p: OpPlan) -> str:
    from .shrink import describe
    return describe(p.shrink)


def _range(p: OpPlan) -> str:
    """An op planned over a token range: its estimated time against dense at the range's ends."""
    if not p.rows_us:
        return ""
    ends = [p.rows_us[0]] + p.rows_us[-1:] if len(p.rows_us) > 1 else p.rows_us
    many = p.kernel is not None and len(p.kernel.by_rows()) > 1 and not p.kernel.bucket_us   # else: the kernel column

    def on(r):
        return f" ({p.kernel.kernel_at(r)})" if many else ""
    return "over the token range " + ", ".join(f"M={r}: {e:.1f}/{d:.1f} µs{on(r)}" for r, e, d in ends)


def _cpu_kernels(p: OpPlan) -> str:
    """The CPU kernels of a sparse op: one ``cpu_linear`` kernel per sub-operator (block, fine; dense = full grid)."""
    kinds = {"dense": "block", "block_sparse": "block", "fine_sparse": "fine"}
    return "cpu_linear[" + ", ".join(kinds[s.template] for s in p.subops) + "]"


def _op_to_json(p: OpPlan) -> dict:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(OpPlan)}
    d["subops"] = [_sub_to_json(s) for s in p.subops]
    d["candidates"] = [dataclasses.asdict(c) for c in p.candidates]
    d["bits"] = {str(k): v for k, v in p.bits.items()}
    d["gemm"] = list(p.gemm) if p.gemm else None
    d["weight_quant"] = {str(b): {**dataclasses.asdict(q), "clip": _pack_floats(q.clip)} for b, q in p.weight_quant.items()}
    d["kernel"] = dataclasses.asdict(p.kernel) if p.kernel is not None else None
    return d


def _pack_floats(values: list[float]) -> str:
    """float32 values as base64 of zlib (a clip ratio per channel: thousands of repeats of a few values)."""
    return base64.b64encode(zlib.compress(struct.pack(f"<{len(values)}f", *values))).decode()


def _unpack_floats(text) -> list[float]:
    if isinstance(text, list):
        return [float(v) for v in text]
    try:
        raw = zlib.decompress(base64.b64decode(text, validate=True))
    except (ValueError, TypeError, zlib.error) as exc:
        raise PlanError(f"malformed float list in plan JSON: {exc}") from exc
    if len(raw) % 4:
        raise PlanError("malformed float list in plan JSON (length)")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


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
    quant = {}
    for bits, q in (d.get("weight_quant") or {}).items():
        _check_fields(WeightQuant, q, "weight quantisation")
        quant[int(bits)] = WeightQuant(**{**q, "clip": _unpack_floats(q.get("clip", []))})
    kernel = d.get("kernel")
    if kernel is not None:
        _check_fields(KernelChoice, kernel, "kernel choice")
        kernel = KernelChoice(**kernel)
    fields = {**d, "subops": subs, "candidates": cands, "bits": {int(k): v for k, v in d.get("bits", {}).items()},
              "weight_quant": quant, "kernel": kernel}
    return OpPlan(**fields)
