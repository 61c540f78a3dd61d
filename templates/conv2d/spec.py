"""Block-sparse implicit-GEMM 2-D convolution for CUDA: the spec, weight packing and torch reference (TVM-free).

The convolution ``Y = act(conv(X, W) + b + R)`` runs on channels-last tensors: ``X`` is ``(NB, H, W, Cin)``, ``Y``
and the optional residual ``R`` are ``(NB, OH, OW, Cout)`` (held as ``(M, Cout)``, ``M = NB·OH·OW``), fp16 or bf16;
``W`` is torch's ``(Cout, Cin, KH, KW)``. As a GEMM (im2col on the fly) the rows are the output pixels and the
reduction runs over ``(kh, kw, cin)``: the reduction is cut into *K blocks*, one per tap ``(r, s)`` and block of
``bk`` input channels (``kb = (r·KW + s)·CB + cb``, ``CB = ceil(Cin / bk)``), and the output channels into block rows
of ``bn``. A weight block ``(row, kb)`` is ``W[row·bn : +bn, cb·bk : +bk, r, s]``; only kept blocks are packed
(``Wp``: ``(nnz, bn, bk)``, zero-padded past ``Cout`` and ``Cin``) and visited through a table (``Tab``: the
``R + 1`` offsets of each block row's first packed block, then every packed block's ``kb``), so pruned blocks are
never loaded and an all-pruned block row outputs ``act(b + R)``.

One CTA computes a ``tm × bn`` tile of ``Y`` (``tm`` output pixels, which may span images): per kept block, the
``tm × bk`` slice of the implicit im2col matrix (zero where the tap falls in the padding, past ``M`` or past
``Cin``) and the packed block, through a ``cp.async`` pipeline of ``stages`` into swizzled shared memory, then
``ldmatrix`` + ``mma.sync.m16n8k16`` with fp32 accumulation. ``NB`` (and so ``M``) is a run-time size: one kernel
serves every batch. ``Cin`` must be a multiple of 8 (16-byte rows); ``groups`` must be 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ...errors import SpartaError

ACTIVATIONS = ("none", "relu", "silu")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHARED_LIMIT = 160 * 1024         # dynamic shared memory of one CTA on sm_80 and sm_90 (the launcher opts in past 48 KiB)


class Conv2dError(SpartaError, ValueError):
    """A convolution spec or call the kernels cannot run; the message says why."""


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


@dataclass(frozen=True)
class Conv2dSpec:
    cin: int
    cout: int
    h: int                       # input height and width (the batch is a run-time size)
    w: int
    kh: int = 3
    kw: int = 3
    stride: tuple = (1, 1)
    padding: tuple = (1, 1)
    dilation: tuple = (1, 1)
    groups: int = 1
    bn: int = 64                 # output channels per block row (and per CTA tile)
    bk: int = 32                 # input channels per K block
    tm: int = 128                # output pixels per CTA tile
    warps_m: int = 4
    warps_n: int = 1
    stages: int = 3
    bias: bool = True
    act: str = "none"
    residual: bool = False       # add R (the same shape as Y) before the activation
    dtype: str = "float16"
    name: str = "conv2d"

    def __post_init__(self):
        for f in ("stride", "padding", "dilation"):
            object.__setattr__(self, f, _pair(getattr(self, f)))
        bad = []
        if min(self.cin, self.cout, self.h, self.w, self.kh, self.kw) < 1:
            bad.append("channels, input size and kernel size must be positive")
        if self.groups != 1:
            bad.append(f"groups={self.groups}: only groups=1 is supported")
        if self.cin % 8:
            bad.append(f"Cin={self.cin} must be a multiple of 8 (16-byte rows of channels)")
        if min(self.stride) < 1 or min(self.dilation) < 1 or min(self.padding) < 0:
            bad.append("stride and dilation must be >= 1, padding >= 0")
        if self.bk not in (16, 32, 64) or self.bn % 16 or not 16 <= self.bn <= 128:
            bad.append(f"block {self.bn}x{self.bk}: bk must be 16, 32 or 64, bn a multiple of 16 up to 128")
        if self.tm % (16 * self.warps_m) or self.bn % (16 * self.warps_n):
            bad.append(f"tile {self.tm}x{self.bn} does not split into {self.warps_m}x{self.warps_n} warps of "
                       "16-multiples")
        if self.act not in ACTIVATIONS:
            bad.append(f"activation {self.act!r} not in {ACTIVATIONS}")
        if self.dtype not in DTYPES:
            bad.append(f"dtype {self.dtype!r} must be one of {tuple(DTYPES)}")
        if self.stages < 2:
            bad.append("stages must be >= 2")
        if not bad and min(self.oh, self.ow) < 1:
            bad.append(f"a {self.kh}x{self.kw} kernel (dilation {self.dilation}) does not fit the padded "
                       f"{self.h}x{self.w} input")
        if not bad and self.shared_bytes > SHARED_LIMIT:
            bad.append(f"{self.stages} stages of a {self.tm}x{self.bk} and a {self.bn}x{self.bk} tile need "
                       f"{self.shared_bytes} bytes of shared memory (at most {SHARED_LIMIT})")
        if bad:
            raise Conv2dError(f"conv2d spec {self.name}: " + "; ".join(bad))

    @property
    def oh(self) -> int:
        return (self.h + 2 * self.padding[0] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1

    @property
    def ow(self) -> int:
        return (self.w + 2 * self.padding[1] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1

    @property
    def cin_blocks(self) -> int:
        return -(-self.cin // self.bk)

    @property
    def k_blocks(self) -> int:
        return self.kh * self.kw * self.cin_blocks

    @property
    def row_blocks(self) -> int:
        return -(-self.cout // self.bn)

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def stage_lanes(self) -> int:
        """16-bit lanes of one pipeline stage: the im2col tile, then the weight block."""
        return (self.tm + self.bn) * self.bk

    @property
    def shared_bytes(self) -> int:
        return self.stages * self.stage_lanes * 2

    def rows(self, nb: int) -> int:
        """M: the output pixels of a batch of ``nb`` images."""
        return nb * self.oh * self.ow

    def key(self) -> dict:
        return asdict(self)


def block_mask_of(weight: torch.Tensor, spec: Conv2dSpec) -> torch.Tensor:
    """(row blocks, K blocks) bool: the blocks of ``weight`` (Cout, Cin, KH, KW) holding a nonzero element."""
    co, ci, kh, kw = weight.shape
    rb, cb = spec.row_blocks, spec.cin_blocks
    w = F.pad((weight != 0).permute(0, 2, 3, 1), (0, cb * spec.bk - ci, 0, 0, 0, 0, 0, rb * spec.bn - co))
    return w.reshape(rb, spec.bn, kh * kw, cb, spec.bk).any(4).any(1).reshape(rb, kh * kw * cb)


def expand_block_mask(blocks: torch.Tensor, spec: Conv2dSpec) -> torch.Tensor:
    """The (Cout, Cin, KH, KW) bool mask of the kept elements of a (row blocks, K blocks) block mask."""
    rb, cb = spec.row_blocks, spec.cin_blocks
    m = blocks.reshape(rb, 1, spec.kh, spec.kw, cb, 1).expand(rb, spec.bn, spec.kh, spec.kw, cb, spec.bk)
    m = m.reshape(rb * spec.bn, spec.kh, spec.kw, cb * spec.bk)[:spec.cout, :, :, :spec.cin]
    return m.permute(0, 3, 1, 2).contiguous()


def pack_weight(weight: torch.Tensor, spec: Conv2dSpec, blocks: torch.Tensor | None = None):
    """``(Wp (max(nnz, 1), bn, bk), Tab int32)``: the kept blocks of ``weight`` (all of ``blocks`` if given, else
    those with a nonzero) in the table's order, and the table."""
    if tuple(weight.shape) != (spec.cout, spec.cin, spec.kh, spec.kw):
        raise Conv2dError(f"conv2d {spec.name}: weight must be (Cout, Cin, KH, KW) = "
                          f"{(spec.cout, spec.cin, spec.kh, spec.kw)}, got {tuple(weight.shape)}")
    blocks = block_mask_of(weight, spec) if blocks is None else blocks.bool()
    if tuple(blocks.shape) != (spec.row_blocks, spec.k_blocks):
        raise Conv2dError(f"conv2d {spec.name}: block mask must be {(spec.row_blocks, spec.k_blocks)}, "
                          f"got {tuple(blocks.shape)}")
    rb, cb = spec.row_blocks, spec.cin_blocks
    w = F.pad(weight.permute(0, 2, 3, 1), (0, cb * spec.bk - spec.cin, 0, 0, 0, 0, 0, rb * spec.bn - spec.cout))
    w = w.reshape(rb, spec.bn, spec.kh * spec.kw, cb, spec.bk).permute(0, 2, 3, 1, 4)
    w = w.reshape(rb, spec.k_blocks, spec.bn, spec.bk)
    rows, kbs = torch.nonzero(blocks, as_tuple=True)                # row-major: by block row, then kb
    packed = w[rows, kbs] if len(rows) else torch.zeros(1, spec.bn, spec.bk, dtype=weight.dtype)
    counts = blocks.sum(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    table = torch.cat([offsets, kbs.to(torch.int64)]).to(torch.int32)
    return packed.contiguous(), table


def conv2d_ref(x: torch.Tensor, weight: torch.Tensor, blocks: torch.Tensor | None, bias: torch.Tensor | None,
               spec: Conv2dSpec, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's function in fp32 on channels-last tensors: ``x`` (NB, H, W, Cin) → (NB, OH, OW, Cout) in ``x``'s
    dtype; the weight's pruned blocks (``blocks`` False) are zero; ``residual`` (NB, OH, OW, Cout) is added before the
    activation."""
    from ..epilogue_ref import activate
    w = weight.float()
    if blocks is not None:
        w = w * expand_block_mask(blocks.bool(), spec)
    y = F.conv2d(x.permute(0, 3, 1, 2).float(), w, None if bias is None else bias.float(), spec.stride,
                 spec.padding, spec.dilation)
    y = y.permute(0, 2, 3, 1)
    if residual is not None:
        y = y + residual.float()
    return activate(y, spec.act).to(x.dtype)


def check_inputs(spec: Conv2dSpec, x: torch.Tensor, residual: torch.Tensor | None) -> int:
    """Refuse inputs the kernel cannot read; returns the batch NB."""
    where, dtype = f"conv2d {spec.name}", DTYPES[spec.dtype]
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or tuple(x.shape[1:]) != (spec.h, spec.w, spec.cin):
        raise Conv2dError(f"{where}: x must be (NB, H, W, Cin) = (NB, {spec.h}, {spec.w}, {spec.cin}), got "
                          f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype != dtype:
        raise Conv2dError(f"{where}: x must be {dtype}, got {x.dtype}")
    nb = x.shape[0]
    if spec.residual != (residual is not None):
        raise Conv2dError(f"{where}: the kernel was built {'with' if spec.residual else 'without'} a residual")
    if residual is not None and (tuple(residual.shape) != (nb, spec.oh, spec.ow, spec.cout)
                                 or residual.dtype != dtype):
        raise Conv2dError(f"{where}: the residual must be {dtype} (NB, OH, OW, Cout) = "
                          f"{(nb, spec.oh, spec.ow, spec.cout)}, got {residual.dtype} {tuple(residual.shape)}")
    if x.numel() >= 2 ** 31 or spec.rows(nb) * spec.cout >= 2 ** 31:
        raise Conv2dError(f"{where}: tensors of 2**31 elements or more are over the kernel's 32-bit indices")
    return nb


__all__ = ["Conv2dSpec", "Conv2dError", "ACTIVATIONS", "DTYPES", "block_mask_of", "expand_block_mask",
           "pack_weight", "conv2d_ref", "check_inputs"]
