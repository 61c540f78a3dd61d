"""Hardware profiles: what a target runs and what each block shape costs there.

A profile is JSON shipped in ``passes/profiles/`` (``cpu.json``, ``cuda.json``), written by
``python -m sparta.codegen.profile --target ...`` from measurements. It lists the kernels
the target runs, each a pair (weight bits, activation bits), with:

* ``dense_gflops``: the dense GEMM rate (the dense path's cost, vendor library);
* ``blocks``: time per block per activation row, in ns, for each candidate block shape
  ``"BHxBW"`` (BH output rows × BW input columns of the weight);

plus a fixed per-kernel cost (launch, loop setup) and the memory bandwidth used to
estimate ops that stay on torch. ``source`` says how the numbers were measured (until
sparta's kernels exist, on stand-ins: batched GEMMs over the blocks, CSR SpMM).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ...errors import PlanError

PROFILE_FILES = {"cpu": "cpu.json", "cuda": "cuda.json"}


@dataclass(frozen=True)
class KernelCosts:
    weight_bits: int
    act_bits: int
    dense_gflops: float
    blocks: dict[tuple[int, int], float]  # (bh, bw) -> ns per block per activation row
    # integer weights: the code width the kernel's arithmetic holds exactly (0: weight_bits). x86 without VNNI
    # multiplies u8·s8 pairs into int16 (vpmaddubsw), which saturates unless the weight codes keep 7 bits.
    weight_code_bits: int = 0
    # (bh, bw) -> ns per block of a one-row call: with ``blocks`` (at the profile's ``rows``) a cost per block that
    # does not shrink with the rows (loading and dequantising the weights) apart from one per row
    blocks_one_row: dict[tuple[int, int], float] = field(default_factory=dict)
    dense_blocks: tuple[int, int] | None = None    # the dense path runs sparta's kernel over these blocks (no vendor)
    dense_gflops_rows: dict[int, float] = field(default_factory=dict)   # rows -> the dense rate at so few rows
    # (bh, bw) -> ns per block per row as ``blocks`` but at the profile's ``wide_k`` input width: a block row's panel of
    # X outgrows the core's L2 there, and every kept block costs more
    blocks_wide_k: dict[tuple[int, int], float] = field(default_factory=dict)

    def dense_rate(self, m: int) -> float:
        """The dense GEMM's GFLOP/s at ``m`` rows: ``dense_gflops``, or below the rows of ``dense_gflops_rows``
        interpolated between them in log(rows)."""
        table = sorted(self.dense_gflops_rows.items())
        if not table or m >= table[-1][0] * 4:
            return self.dense_gflops
        points = table + [(table[-1][0] * 4, self.dense_gflops)]
        if m <= points[0][0]:
            return points[0][1]
        for (m0, r0), (m1, r1) in zip(points, points[1:]):
            if m0 <= m <= m1:
                t = (math.log(m) - math.log(m0)) / (math.log(m1) - math.log(m0))
                return r0 + t * (r1 - r0)
        return self.dense_gflops

    def block_shapes(self) -> list[tuple[int, int]]:
        return sorted(self.blocks, key=lambda s: -s[0] * s[1])


@dataclass(frozen=True)
class HardwareProfile:
    target: str
    device: str
    date: str
    source: str
    fixed_us: float
    bandwidth_gbs: float
    kernels: tuple[KernelCosts, ...]
    notes: dict = field(default_factory=dict)
    sparse_ops: tuple[str, ...] = ("linear", "addmm", "mm", "matmul")  # ops with sparse templates
    # dismantle policy (measured, see the JSON's notes): unroll an op's blocks into code up to
    # this many blocks; beyond it use ``large_dismantle`` ("tile": per-row constant lists;
    # "none": the generic kernel, one per shape, shared by every layer of that shape)
    full_max_blocks: int = 512
    large_dismantle: str = "tile"
    # weights stream from memory on every call (a GPU's L2 or a CPU's L3 holds a layer, not a model): GEMM
    # costs are at least their weight bytes / bandwidth, so decode-like shapes favour fewer bits.
    stream_weights: bool = False
    # the host time of one call of a sparta kernel module (argument checks, padding, the FFI call) where it
    # exceeds ``fixed_us`` (a vendor op's call): a sparse sub-operator pays it once (0: ``fixed_us``)
    kernel_call_us: float = 0.0
    rows: int = 0                   # activation rows of the ``blocks`` measurements (0: unknown, cost linear in rows)
    k: int = 0                      # input width K of the ``blocks`` measurements
    wide_k: int = 0                 # input width K of the ``blocks_wide_k`` measurements (0: none)
    low_bit_gemv: dict = field(default_factory=dict)     # family -> {rows: [fixed µs, GB/s]} (``low_bit_gemv_us``)

    # ---- what the hardware runs ---------------------------------------------------------
    def act_widths(self) -> list[int]:
        return sorted({k.act_bits for k in self.kernels})

    def weight_widths(self, act_bits: int) -> list[int]:
        return sorted({k.weight_bits for k in self.kernels if k.act_bits == act_bits})

    def kernel(self, weight_bits: int, act_bits: int) -> KernelCosts:
        for k in self.kernels:
            if k.weight_bits == weight_bits and k.act_bits == act_bits:
                return k
        raise PlanError(f"profile {self.target!r} has no kernel for W{weight_bits}A{act_bits}")

    def code_bits(self, weight_bits: int) -> int:
        """The code width integer weights of ``weight_bits`` are quantised to (their kernels' narrowest)."""
        codes = [k.weight_code_bits or k.weight_bits for k in self.kernels if k.weight_bits == weight_bits]
        return min(codes) if codes else weight_bits

    @staticmethod
    def round_up(bits: int, widths: list[int]) -> int:
        """The smallest supported width holding ``bits`` (the widest if none does)."""
        for w in sorted(widths):
            if w >= bits:
                return w
        return max(widths)

    # ---- cost model (µs) -----------------------------------------------------------------
    def dense_us(self, m: int, n: int, k: int, weight_bits: int, act_bits: int) -> float:
        """Launch + the slower of the flops at the kernel's dense rate and streaming its weights
        (few activation rows: decode-like GEMMs are bound by the weight bytes, which low bits cut)."""
        kern = self.kernel(weight_bits, act_bits)
        if kern.dense_blocks is not None and kern.dense_blocks in kern.blocks:
            bh, bw = kern.dense_blocks
            return self.sub_op_us + self.block_us(-(-n // bh) * -(-k // bw), kern.dense_blocks, m, weight_bits,
                                                  act_bits, k)
        return self.fixed_us + max(2.0 * m * n * k / (kern.dense_rate(m) * 1e3),
                                   self.weight_stream_us(n * k, weight_bits))

    def block_us(self, n_blocks: int, shape: tuple[int, int], m: int, weight_bits: int, act_bits: int,
                 k: int = 0) -> float:
        """The blocks' measured cost per activation row (at input width ``k``, 0: the profile's), at least the
        time to stream their weights."""
        kern = self.kernel(weight_bits, act_bits)
        ns = kern.blocks.get(tuple(shape))
        if ns is None:
            raise PlanError(f"profile {self.target!r} has no cost for block {shape} at W{weight_bits}A{act_bits}")
        one = kern.blocks_one_row.get(tuple(shape))
        if one is not None and self.rows > 1:     # fixed + per-row cost through the two measured row counts
            per_row = max((ns * self.rows - one) / (self.rows - 1), 0.0)
            per_block = max(one - per_row, 0.0) + per_row * self.k_factor(kern, shape, k) * m
        else:
            per_block = ns * self.k_factor(kern, shape, k) * m
        return max(n_blocks * per_block / 1e3, self.weight_stream_us(n_blocks * shape[0] * shape[1], weight_bits))

    def cover_us(self, n_blocks: int, shape: tuple[int, int], m: int, weight_bits: int, act_bits: int,
                 k: int = 0) -> float:
        """One sub-operator of ``n_blocks`` blocks at ``m`` rows: its kernel call and blocks (:meth:`block_us`), or
        where the GEMV takes ``m`` rows (a 16-bit block cover, ``low_bit_gemv["bsr_gemv"]``) the GEMV's bytes model
        if cheaper (per-block latency measured on a small weight overprices a large one)."""
        us = self.sub_op_us + self.block_us(n_blocks, shape, m, weight_bits, act_bits, k)
        gemv = self.gemv_bytes_us(n_blocks, shape, m, weight_bits)
        return us if gemv is None else min(us, gemv)

    def gemv_bytes_us(self, n_blocks: int, shape: tuple[int, int], m: int, weight_bits: int) -> float | None:
        """The 16-bit block-sparse GEMV streaming ``n_blocks`` blocks at ``m`` rows by its fitted fixed cost and
        rate (``low_bit_gemv["bsr_gemv"]``), None above its rows or without a fit."""
        fit = self.low_bit_gemv.get("bsr_gemv")
        if not fit or weight_bits != 16 or m > max(int(r) for r in fit):
            return None
        return self.low_bit_gemv_us("bsr_gemv", m, n_blocks * shape[0] * shape[1] * 2)

    # ---- one kernel's cost (µs; None: the profile has no cost for it) ----------------------
    def gemv_us(self, n_blocks: int, shape: tuple[int, int], m: int, weight_bits: int, act_bits: int,
                k: int = 0) -> float | None:
        """The few-row block-sparse GEMV over ``n_blocks`` blocks at ``m`` rows: by its bytes where the profile
        fits them (:meth:`gemv_bytes_us`), else its cost per block measured at one row (``blocks_one_row``) and the
        per-row cost above it, one kernel call."""
        if (fit := self.gemv_bytes_us(n_blocks, shape, m, weight_bits)) is not None:
            return fit
        kern = self.kernel(weight_bits, act_bits)
        if tuple(shape) not in kern.blocks_one_row or tuple(shape) not in kern.blocks or self.rows <= 1:
            return None
        return self.sub_op_us + self.block_us(n_blocks, shape, m, weight_bits, act_bits, k)

    def tile_us(self, n_blocks: int, shape: tuple[int, int], m: int, tm: int, weight_bits: int, act_bits: int,
                k: int = 0) -> float | None:
        """A tile kernel of ``tm`` rows per tile over ``n_blocks`` blocks at ``m`` rows: the blocks' cost per row
        (``blocks``, measured on the tile kernels) over ``m`` rounded up to whole tiles (a tile computes all its rows),
        at least the blocks' weight bytes over the bandwidth, one kernel call."""
        kern = self.kernel(weight_bits, act_bits)
        ns = kern.blocks.get(tuple(shape))
        if ns is None:
            return None
        rows = -(-max(m, 1) // tm) * tm
        return self.sub_op_us + max(n_blocks * ns * self.k_factor(kern, shape, k) * rows / 1e3,
                                    self.weight_stream_us(n_blocks * shape[0] * shape[1], weight_bits))

    def dense_tile_us(self, m: int, tm: int, n: int, k: int, weight_bits: int, act_bits: int) -> float:
        """sparta's dense tile kernel (every block computed) of ``tm`` rows per tile at ``m`` rows: the kernel's
        dense rate (``dense_gflops``, measured on its tiles) over ``m`` rounded up to whole tiles, at least the
        weight bytes over the bandwidth, one kernel call."""
        kern = self.kernel(weight_bits, act_bits)
        rows = -(-max(m, 1) // tm) * tm
        return self.sub_op_us + max(2.0 * rows * n * k / (kern.dense_gflops * 1e3),
                                    self.weight_stream_us(n * k, weight_bits))

    def low_bit_gemv_us(self, family: str, m: int, nbytes: int) -> float | None:
        """A few-row GEMV (``w4a16_gemv``, ``w8a8_gemv``, ``nm_linear``, ...) streaming ``nbytes`` at ``m`` rows: a
        fixed cost plus the bytes at its measured rate, both linear in the rows between the two measured row counts
        around ``m`` (flat outside them)."""
        points = sorted((int(r), v) for r, v in self.low_bit_gemv.get(family, {}).items())
        if not points:
            return None
        i = next((i for i, (r, _) in enumerate(points) if r >= m), len(points) - 1)
        (r0, (c0, g0)), (r1, (c1, g1)) = points[max(i - 1, 0)], points[i]
        t = 0.0 if r1 == r0 else min(max((m - r0) / (r1 - r0), 0.0), 1.0)
        return c0 + t * (c1 - c0) + nbytes / ((g0 + t * (g1 - g0)) * 1e3)

    def dequant_us(self, n: int, k: int, read_bytes: int, write_bits: int = 16) -> float:
        """Writing an (N, K) weight of ``write_bits`` from ``read_bytes`` of packed codes and scales (a many-row
        call's per-call dequantisation): one kernel call and the bytes at the bandwidth."""
        return self.fixed_us + (read_bytes + n * k * write_bits // 8) / (self.bandwidth_gbs * 1e3)

    def k_factor(self, kern: KernelCosts, shape: tuple[int, int], k: int) -> float:
        """How much more a block's per-row work costs at input width ``k`` than at the profile's: linear in K
        between the two measured widths, flat outside them, never less (a wider K is never cheaper per block)."""
        wide = kern.blocks_wide_k.get(tuple(shape))
        if wide is None or not k or self.wide_k <= self.k:
            return 1.0
        t = min(max((k - self.k) / (self.wide_k - self.k), 0.0), 1.0)
        return 1.0 + t * max(wide / kern.blocks[tuple(shape)] - 1.0, 0.0)

    @property
    def sub_op_us(self) -> float:
        """The fixed cost of one sparse sub-operator's kernel call."""
        return self.kernel_call_us or self.fixed_us

    def memory_us(self, nbytes: int) -> float:
        return nbytes / (self.bandwidth_gbs * 1e3)

    def weight_stream_us(self, elements: int, bits: int) -> float:
        """Time to read ``elements`` weights of ``bits`` (0 unless the profile streams weights)."""
        return self.memory_us(elements * bits // 8) if self.stream_weights else 0.0

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"target": self.target, "device": self.device, "date": self.date, "source": self.source,
                "fixed_us": self.fixed_us, "bandwidth_gbs": self.bandwidth_gbs, "notes": self.notes,
                "sparse_ops": list(self.sparse_ops),
                "dismantle": {"full_max_blocks": self.full_max_blocks, "large": self.large_dismantle},
                "stream_weights": self.stream_weights,
                **({"kernel_call_us": self.kernel_call_us} if self.kernel_call_us else {}),
                **({"rows": self.rows} if self.rows else {}),
                **({"k": self.k} if self.k else {}),
                **({"wide_k": self.wide_k} if self.wide_k else {}),
                **({"low_bit_gemv": self.low_bit_gemv} if self.low_bit_gemv else {}),
                "kernels": [{"weight_bits": k.weight_bits, "act_bits": k.act_bits, "dense_gflops": k.dense_gflops,
                             "blocks": {f"{a}x{b}": v for (a, b), v in k.blocks.items()},
                             **({"weight_code_bits": k.weight_code_bits} if k.weight_code_bits else {}),
                             **({"blocks_one_row": {f"{a}x{b}": v for (a, b), v in k.blocks_one_row.items()}}
                                if k.blocks_one_row else {}),
                             **({"dense_blocks": f"{k.dense_blocks[0]}x{k.dense_blocks[1]}"} if k.dense_blocks
                                else {}),
                             **({"dense_gflops_rows": {str(r): v for r, v in k.dense_gflops_rows.items()}}
                                if k.dense_gflops_rows else {}),
                             **({"blocks_wide_k": {f"{a}x{b}": v for (a, b), v in k.blocks_wide_k.items()}}
                                if k.blocks_wide_k else {})}
                            for k in self.kernels]}

    @classmethod
    def from_json(cls, data: dict) -> HardwareProfile:
        try:
            def shapes(table):
                return {_shape(s): float(v) for s, v in table.items()}
            kernels = tuple(KernelCosts(int(k["weight_bits"]), int(k["act_bits"]), float(k["dense_gflops"]),
                                        shapes(k["blocks"]), int(k.get("weight_code_bits", 0)),
                                        shapes(k.get("blocks_one_row", {})),
                                        _shape(k["dense_blocks"]) if k.get("dense_blocks") else None,
                                        {int(r): float(v) for r, v in k.get("dense_gflops_rows", {}).items()},
                                        shapes(k.get("blocks_wide_k", {})))
                            for k in data["kernels"])
            if not kernels:
                raise ValueError("no kernels")
            dis = data.get("dismantle", {})
            large = str(dis.get("large", "tile"))
            if large not in ("none", "tile", "full"):
                raise ValueError(f"unknown dismantle level {large!r}")
            return cls(data["target"], data.get("device", ""), data.get("date", ""), data.get("source", ""),
                       float(data["fixed_us"]), float(data["bandwidth_gbs"]), kernels, dict(data.get("notes", {})),
                       tuple(data.get("sparse_ops", cls.sparse_ops)), int(dis.get("full_max_blocks", 512)), large,
                       bool(data.get("stream_weights", False)), float(data.get("kernel_call_us", 0.0)),
                       int(data.get("rows", 0)), int(data.get("k", 0)), int(data.get("wide_k", 0)),
                       {f: {str(r): [float(c), float(g)] for r, (c, g) in v.items()}
                        for f, v in data.get("low_bit_gemv", {}).items()})
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise PlanError(f"invalid hardware profile: {exc}") from exc


def _shape(text: str) -> tuple[int, int]:
    bh, bw = (int(x) for x in text.split("x"))
    return bh, bw


def load_profile(target_or_path) -> HardwareProfile:
    """The shipped profile of ``"cpu"``/``"cuda"``, or a profile JSON file."""
    if isinstance(target_or_path, HardwareProfile):
        return target_or_path
    if str(target_or_path) in PROFILE_FILES:
        text = resources.files("sparta.passes").joinpath("profiles", PROFILE_FILES[str(target_or_path)]).read_text()
    else:
        path = Path(target_or_path)
        if not path.is_file():
            raise PlanError(f"no hardware profile for {target_or_path!r} (targets: {sorted(PROFILE_FILES)})")
        text = path.read_text()
    return HardwareProfile.from_json(json.loads(text))
