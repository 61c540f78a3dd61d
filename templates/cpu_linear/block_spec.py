"""CPU block-sparse linear ``Y = X · Wᵀ (+ b, activation)``: spec, packing, torch reference (TVM-free).

The weight is stored as its kept ``BH × BW`` blocks only, each ``k``-major
(``W[p, kk, r]`` = ``w[bi·BH + r, bj·BW + kk]``). How the kernel (``block.py``) finds the kept blocks is the
dismantle level (``spec.dismantle``):

* ``"none"``: the generic BCSR kernel, reading row pointers ``P`` and columns ``C`` at run time;
* ``"full"``: every grid block is emitted under a compile-time condition and TVM's
  simplifier deletes the pruned ones: no index array, no code for pruned blocks;
* ``"tile"``: block rows are specialised (empty rows vanish, loop bounds are constants)
  but a row's blocks are looped over a compile-time column list, bounding code size.

Weight precisions: 32 (fp32), 8 (int8 × int8 activations, int32 accumulation, per-row
activation scale × per-channel weight scale; or with ``act_bits=32`` int8 weights against fp32 activations,
fp32 accumulation, the per-channel scale applied once in the epilogue), 4 (int4 codes ``u`` dequantised to fp32 in the
loop as ``u · S + O``: one scale and offset per block row and ``scale_group`` columns, which
holds symmetric (``O = -8 S``) and asymmetric (``O = -zero · S``) quantisation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..quant.spec import quantize_rows  # noqa: F401  (the per-token int8 rule, shared)

from .epilogue import torch_epilogue


PANEL = 64          # rows of X per parallel task of the kernel (block.py)


def vector_width(bh: int) -> int:
    """The kernel's register slice: the widest of 16, 8, 4, 2 rows that divides the block height."""
    for rv in (16, 8, 4, 2):
        if bh % rv == 0:
            return rv
    return 1


@dataclass(frozen=True)
class BlockLinearSpec:
    m: int                                  # rows of X; 0: any (the kernel takes M at run time)
    n: int                                  # multiple of block[0]
    k: int                                  # multiple of block[1]
    block: tuple[int, int]
    rows: tuple[tuple[int, ...], ...]       # kept block columns of each block row
    weight_bits: int = 32
    bias: bool = False
    activation: str | None = None
    accumulate: bool = False
    dismantle: str = "full"
    name: str = "block_linear"
    scale_group: int = 0                    # int4: columns per scale inside a block (0: the block width)
    act_bits: int = 0                       # 32: fp32 activations with int8 weights (weight-only); 0: the width's own

    def __post_init__(self):
        bh, bw = self.block
        if self.n % bh or self.k % bw or len(self.rows) != self.n // bh:
            raise ValueError(f"spec {self.name}: N={self.n}, K={self.k} must be multiples of the block {self.block} "
                             f"and rows must list {self.n // bh} block rows")
        if self.weight_bits not in (32, 8, 4) or (self.weight_bits == 4 and bh % 2):
            raise ValueError(f"spec {self.name}: unsupported weight bits {self.weight_bits} for block {self.block}")
        if self.weight_bits == 4 and bw % self.group_columns:
            raise ValueError(f"spec {self.name}: scale_group {self.scale_group} must divide the block width {bw}")
        if self.dismantle not in ("none", "full", "tile"):
            raise ValueError(f"spec {self.name}: unknown dismantle level {self.dismantle!r}")

    @property
    def int8_activations(self) -> bool:
        """int8 weights run against per-token int8 activation codes (W8A8) unless ``act_bits`` says fp32."""
        return self.weight_bits == 8 and self.act_bits != 32

    @property
    def row_parallel(self) -> bool:
        """Whether the kernel parallelises over block rows (the generic kernel at fewer than two panels of rows,
        ``block.PANEL``): a decode-sized GEMM then runs on every thread."""
        return self.dismantle == "none" and 0 < self.m < 2 * PANEL

    @property
    def group_columns(self) -> int:
        return self.scale_group or self.block[1]

    @property
    def n_blocks(self) -> int:
        return sum(len(r) for r in self.rows)

    def offsets(self) -> list[int]:
        """Packed index of each block row's first block."""
        out, p = [], 0
        for r in self.rows:
            out.append(p)
            p += len(r)
        return out

    def key(self) -> dict:
        """What the compiled code depends on: a generic (``"none"``) kernel reads the block
        structure at run time, so every weight of one shape shares it."""
        d = asdict(self)
        if self.dismantle == "none":
            d["rows"] = None
        return d

    def generic_name(self) -> str:
        """A name for the shared generic kernel of this shape."""
        bh, bw = self.block
        tail = "".join(["_b" if self.bias else "", f"_{self.activation}" if self.activation else "",
                        "_acc" if self.accumulate else "",
                        f"_g{self.scale_group}" if self.weight_bits == 4 and self.scale_group else "",
                        "_a32" if self.weight_bits == 8 and not self.int8_activations else ""])
        return f"bsr_m{self.m}_n{self.n}_k{self.k}_{bh}x{bw}_w{self.weight_bits}{tail}"


def pack(spec: BlockLinearSpec, weight: torch.Tensor, scale: torch.Tensor | None = None,
         zero: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Kernel arguments holding only the kept blocks of ``weight`` (N, K) (plus scales/indices).

    Quantised widths take fitted element-wise ``scale`` (and, for asymmetric int4, ``zero``: the
    integer code of 0) of shape (N, K), constant over each kernel scale group; without them the
    scales come from each group's absolute maximum (symmetric).
    """
    bh, bw = spec.block
    w = weight.detach().to(torch.float32).reshape(spec.n // bh, bh, spec.k // bw, bw)
    coords = [(i, j) for i, row in enumerate(spec.rows) for j in row]

    def blocks_of(t):                                   # (nb, bw, bh) k-major
        t = t.reshape(spec.n // bh, bh, spec.k // bw, bw)
        return torch.stack([t[i, :, j, :].t() for i, j in coords]) if coords else torch.zeros(1, bw, bh)

    wp = blocks_of(w)
    out = {}
    if spec.weight_bits == 32:
        out["W"] = wp.contiguous()
    elif spec.weight_bits == 8:
        if zero is not None:
            raise ValueError(f"spec {spec.name}: int8 weights are symmetric (the int8 dot product has no zero point)")
        if scale is None:
            ch = weight.detach().to(torch.float32).abs().amax(1).clamp_min(1e-12) / 127.0      # per channel
        else:
            ch = scale[:, 0].to(torch.float32)
            if not torch.equal(scale, ch[:, None].expand_as(scale)):
                raise ValueError(f"spec {spec.name}: int8 weight scales must be per channel")
        rows = torch.cat([torch.arange(i * bh, (i + 1) * bh) for i, _ in coords]) if coords \
            else torch.zeros(bh, dtype=torch.long)
        out["W"] = torch.round(wp / ch[rows].reshape(-1, 1, bh)).clamp(-127, 127).to(torch.int8).contiguous()
        out["WS"] = ch.contiguous()
    else:
        gc = spec.group_columns
        g = bw // gc
        if scale is None:
            s = wp.reshape(-1, g, gc, bh).abs().amax(2).clamp_min(1e-12) / 7.0                 # (nb, G, bh)
            z = torch.full_like(s, 8.0)
        else:
            s = blocks_of(scale.to(torch.float32))[:, ::gc, :].contiguous()
            z = torch.full_like(s, 8.0) if zero is None else blocks_of(zero.to(torch.float32))[:, ::gc, :]
        step = s.repeat_interleave(gc, dim=1)
        lo = 1 if zero is None else 0                   # symmetric codes are -7..7 (u = q + 8)
        q = (torch.round(wp / step) + z.repeat_interleave(gc, dim=1)).clamp(lo, 15).to(torch.uint8)
        out["W"] = _nibbles(q, vector_width(bh))
        out["S"] = s.contiguous()
        out["O"] = (-z * s).contiguous()
    if spec.dismantle != "full":
        out["C"] = torch.tensor([j for row in spec.rows for j in row] or [0], dtype=torch.int32)
    if spec.dismantle == "none":
        out["P"] = torch.tensor(spec.offsets() + [spec.n_blocks], dtype=torch.int32)
    return out


def _nibbles(q: torch.Tensor, rv: int) -> torch.Tensor:
    """int4 codes (nb, bw, bh) as bytes (nb, bw, bh/2): in each slice of ``rv`` rows, byte j holds row j in its low
    nibble and row j + rv/2 in its high one (the kernel loads each half of a slice as contiguous bytes)."""
    nb, bw, bh = q.shape
    s = q.reshape(nb, bw, bh // rv, 2, rv // 2)
    return (s[:, :, :, 0] | (s[:, :, :, 1] << 4)).reshape(nb, bw, bh // 2).contiguous()


def dequantized_weight(spec: BlockLinearSpec, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense (N, K) fp32 weight the kernel computes with (after quantisation)."""
    bh, bw = spec.block
    if spec.weight_bits == 32:
        wp = packed["W"]
    elif spec.weight_bits == 8:
        rows = torch.cat([torch.arange(i * bh, (i + 1) * bh) for i, row in enumerate(spec.rows) for _ in row]) \
            if spec.n_blocks else torch.zeros(bh, dtype=torch.long)
        wp = packed["W"].to(torch.float32) * packed["WS"][rows].reshape(-1, 1, bh)
    else:
        b = packed["W"].reshape(packed["W"].shape[0], bw, bh // vector_width(bh), vector_width(bh) // 2)
        u = torch.stack([b & 15, b >> 4], dim=-2).reshape(b.shape[0], bw, bh).to(torch.float32)
        gc = spec.group_columns
        wp = u * packed["S"].repeat_interleave(gc, dim=1) + packed["O"].repeat_interleave(gc, dim=1)
    w = torch.zeros(spec.n // bh, bh, spec.k // bw, bw)
    p = 0
    for i, row in enumerate(spec.rows):
        for j in row:
            w[i, :, j, :] = wp[p].t()
            p += 1
    return w.reshape(spec.n, spec.k)


def reference(spec: BlockLinearSpec, x: torch.Tensor, packed: dict, bias=None, y=None) -> torch.Tensor:
    """What the kernel computes, in fp64 torch ops."""
    w = dequantized_weight(spec, packed).double()
    if spec.int8_activations:
        q, s = quantize_rows(x)
        x = q.double() * s.double()[:, None]
    return torch_epilogue(spec, x.double() @ w.t(), bias, y)


def argument_names(spec: BlockLinearSpec) -> list[str]:
    names = ["X"] + (["XS"] if spec.int8_activations else []) + ["W"]
    names += ["S", "O"] if spec.weight_bits == 4 else []
    names += ["WS"] if spec.weight_bits == 8 else []
    names += ["C"] if spec.dismantle != "full" else []
    names += ["P"] if spec.dismantle == "none" else []
    names += ["B"] if spec.bias else []
    return names + ["Y"]
