"""The launchers of the ``bsr_linear`` kernels over packed blocks (no TVM needed): :class:`BsrLinearOp` (the tile
kernel; ``BsrLinearOp(folder, spec, weight, block_mask, bias)`` packs the kept blocks once, ``BsrLinearOp.packed``
takes them packed) and :class:`BsrGemvOp` (the few-row GEMV over the same blocks), and the spec's JSON form.

``op(x)`` computes ``act(x · (W ⊙ mask)ᵀ + b)`` in fp16/bf16 on the current stream. An int8 (W8A8) kernel quantises
the weight per channel at construction and ``x`` per row; ``op.int8(xq, xs)`` takes activations already quantised. A
kernel built with ``out="int8"`` returns int8 codes of the static ``out_scale``. A W4A16 kernel (``dtype="w4a16"``)
holds int4 block records (``int4_records.py``) and takes 16-bit ``x``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .int4_records import expand_groups, gemv_layout, pack_w4, quantize_w4
from ..w4a16_gemv.spec import flat_views
from .packing import block_mask_for, pack_weight
from .gemv_spec import BsrGemvSpec
from .spec import BsrSpec
from ..quant.runtime import output_scale_arg
from ..quant.spec import quantize_rows
from ...runtime.cuda import CudaKernel, CudaRuntimeError, act16_dtype, check_fp16_input, check_saved_spec, lanes16


def spec_to_json(spec: BsrSpec) -> dict:
    return {**dataclasses.asdict(spec), "pattern": [list(p) for p in spec.pattern]}


def spec_from_json(d: dict) -> BsrSpec:
    return BsrSpec(**{**d, "pattern": tuple(tuple(p) for p in d.get("pattern", ()))})


def load_spec(folder) -> BsrSpec:
    """The spec a kernel folder was built from (``spec.json`` beside ``launch.json``)."""
    return spec_from_json(json.loads((Path(folder) / "spec.json").read_text()))


class BsrLinearOp:
    """One sparse linear: packed weights + table on the GPU, the kernel loaded from ``folder``."""

    def __init__(self, folder, spec: BsrSpec, weight: torch.Tensor, block_mask: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, quantizer=None, group: int = 128, out_scale: float | None = None):
        self.kernel, self.spec = CudaKernel(folder), spec
        self.quantizer = quantizer          # int8: x -> (codes, scales); default: torch ops
        if tuple(weight.shape) != (spec.weight_rows, spec.k):
            raise CudaRuntimeError(f"{spec.name}: weight is {tuple(weight.shape)}, the kernel wants "
                                   f"{(spec.weight_rows, spec.k)}")
        if block_mask is None:
            block_mask = block_mask_for(weight, spec)
        block_mask = block_mask.bool().cpu()
        if spec.table == "const":
            if not torch.equal(spec.pattern_mask(), block_mask):
                raise CudaRuntimeError(f"{spec.name}: the block mask differs from the pattern baked into the kernel")
        scale = None
        if spec.dtype == "w4a16":          # round to nearest, one scale per ``group`` columns
            wp, table = pack_w4(*_expanded_w4(weight, group, spec), spec, block_mask)
        else:
            if spec.dtype == "int8":
                weight, scale = quantize_rows(weight)
            wp, table = pack_weight(weight if scale is not None else weight.to(act16_dtype(spec)), spec, block_mask)
        self._setup(wp, table, bias, scale, out_scale)

    @classmethod
    def packed(cls, folder, spec: BsrSpec, wp: torch.Tensor, table: torch.Tensor,
               bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
               out_scale: float | None = None) -> BsrLinearOp:
        """An op from weights already packed by ``pack_weight`` (what a saved model holds)."""
        op = cls.__new__(cls)
        op.kernel, op.spec, op.quantizer = CudaKernel(folder), spec, None
        heads = spec.table_head
        block = (2 * spec.w_lanes,) if spec.dtype == "w4a16" else (spec.bn, spec.bk)
        if spec.gemv_group:                # the W4A16 GEMVs' pack: one flat buffer
            try:
                flat_views(wp, gemv_layout(spec))
            except ValueError as e:
                raise CudaRuntimeError(str(e)) from None
            block, wp_blocks = (), spec.row_blocks * spec.k_blocks
        else:
            wp_blocks = wp.shape[0] if wp.dim() else 0
        if wp.dim() != len(block) + 1 or tuple(wp.shape[1:]) != block or table.dtype != torch.int32 \
                or table.numel() < heads or table.numel() - heads > wp_blocks:
            raise CudaRuntimeError(f"{spec.name}: packed weights {tuple(wp.shape)} / table {table.numel()} "
                                   f"do not fit the kernel's {spec.bn}x{spec.bk} blocks over {spec.weight_row_blocks} "
                                   "rows")
        op._setup(wp, table, bias, weight_scale, out_scale)
        return op

    def _setup(self, wp: torch.Tensor, table: torch.Tensor, bias: torch.Tensor | None,
               weight_scale: torch.Tensor | None = None, out_scale: float | None = None) -> None:
        if self.spec.bias and bias is None:
            raise CudaRuntimeError(f"{self.spec.name}: the kernel adds a bias; pass one")
        if (self.spec.out == "int8") != (out_scale is not None):
            why = "the kernel requantises its output; pass out_scale" if out_scale is None else \
                "out_scale is for out='int8' kernels"
            raise CudaRuntimeError(f"{self.spec.name}: {why}")
        int8 = self.spec.dtype == "int8"
        if int8 and (wp.dtype != torch.int8 or weight_scale is None or weight_scale.numel() != self.spec.n):
            raise CudaRuntimeError(f"{self.spec.name}: the W8A8 kernel takes int8 blocks and {self.spec.n} "
                                   "per-channel weight scales")
        w4 = self.spec.dtype == "w4a16"
        if w4 and (wp.dtype != torch.uint8 or weight_scale is not None):
            raise CudaRuntimeError(f"{self.spec.name}: the W4A16 kernel takes packed int4 block records or the GEMVs' "
                                   "pack (int4_records.pack_w4, scales inside), no separate scales")
        dev = wp.device
        act = act16_dtype(self.spec)
        self.wp, self.table = (wp if int8 or w4 else wp.to(act)).contiguous(), table.to(dev).contiguous()
        self.weight_scale = weight_scale.float().contiguous().to(dev) if int8 else None
        self.bias = bias.to(act).contiguous().to(dev) if bias is not None else \
            torch.zeros(self.spec.weight_rows, dtype=act, device=dev)
        self.out_scale = None if out_scale is None else output_scale_arg(out_scale, dev)
        self._prepared = None
        nnz = self.table.numel() - self.spec.table_head
        self.density = nnz / max(self.spec.weight_row_blocks * self.spec.k_blocks, 1)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        check_fp16_input(s.name, x, s.m, s.k, act16_dtype(s))
        if s.dtype == "int8":
            return self.int8(*(self.quantizer or quantize_rows)(x), out=out)
        y = self._output(x) if out is None else out
        x16, y16 = lanes16(x), lanes16(y)                              # bf16 moves as 16-bit lanes; int8 Y as is
        if self._prepared is None:
            self._prepared = self.kernel.prepare(("X", "Y"), X=x16, Wp=self.wp.view(-1).view(torch.float16),
                                                 B=lanes16(self.bias), Tab=self.table, Y=y16, **self._os())
        else:
            self._prepared.launch(X=x16, Y=y16)
        return y

    def int8(self, xq: torch.Tensor, xs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The W8A8 kernel on activations already quantised per row: int8 ``(M, K)`` codes and fp32 scales."""
        s = self.spec
        if s.dtype != "int8" or xq.dim() != 2 or xq.shape[1] != s.k or (s.m and xq.shape[0] != s.m) \
                or xq.dtype != torch.int8 or not xq.is_contiguous():
            raise CudaRuntimeError(f"{s.name}: int8() takes contiguous int8 ({s.m or 'M'}, {s.k}) codes for a W8A8 "
                                   "kernel")
        y = self._output(xq) if out is None else out
        x16, xs = xq.view(torch.float16), xs.float().contiguous()
        if self._prepared is None:
            self._prepared = self.kernel.prepare(("X", "XS", "Y"), X=x16, XS=xs, Wp=self.wp.view(-1).view(torch.float16),
                                                 WS=self.weight_scale, B=lanes16(self.bias), Tab=self.table,
                                                 Y=lanes16(y), **self._os())
        else:
            self._prepared.launch(X=x16, XS=xs, Y=lanes16(y))
        return y

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.int8 if self.spec.out == "int8" else act16_dtype(self.spec)
        return torch.empty(x.shape[0], self.spec.n, dtype=dtype, device=x.device)

    def _os(self) -> dict:
        return {} if self.out_scale is None else {"OS": self.out_scale}


class BsrGemvOp:
    """The few-row GEMV (``templates/bsr_linear/gemv.py``) over a tile kernel's packed fp16 blocks and table."""

    def __init__(self, folder, spec: BsrGemvSpec, wp: torch.Tensor, table: torch.Tensor, bias: torch.Tensor):
        self.kernel, self.spec = CudaKernel(folder), spec
        self.wp, self.table, self.bias = wp.reshape(-1), table, bias
        self._prepared = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        check_fp16_input(s.name, x, 0, s.k, act16_dtype(s))
        if x.shape[0] > s.rows:
            raise CudaRuntimeError(f"{s.name}: the GEMV takes at most {s.rows} rows, got {x.shape[0]}")
        y = torch.empty(x.shape[0], s.n, dtype=x.dtype, device=x.device)
        x16, y16 = lanes16(x), lanes16(y)
        if self._prepared is None:
            self._prepared = self.kernel.prepare(("X", "Y"), X=x16, Wp=lanes16(self.wp), B=lanes16(self.bias),
                                                 Tab=self.table, Y=y16)
        else:
            self._prepared.launch(X=x16, Y=y16)
        return y


def gemv_fits(spec: BsrSpec, gemv: BsrGemvSpec) -> bool:
    """Whether ``gemv`` reads the packed weights, table and bias of ``spec``'s kernel and computes its epilogue."""
    return (spec.dtype in ("float16", "bfloat16") and spec.out == "float16" and spec.table == "arg"
            and (gemv.n, gemv.k, gemv.bn, gemv.bk, gemv.bias, gemv.act, gemv.groups, gemv.dtype, gemv.gate)
            == (spec.n, spec.k, spec.bn, spec.bk, spec.bias, spec.act, spec.groups, spec.dtype, spec.gate))


def _saved_gemv(config: dict, key: str, folders: dict) -> tuple | None:
    """(folder, spec) of the GEMV a saved op's ``config[key]`` names, its spec checked against the folder's."""
    entry = config.get(key)
    if entry is None:
        return None
    gemv = (folders[entry["kernel"]], BsrGemvSpec(**entry["spec"]))
    check_saved_spec(config["op_name"], *gemv)
    return gemv


def _expanded_w4(weight: torch.Tensor, group: int, spec: BsrSpec):
    group = spec.gemv_group or group       # a tile over the GEMVs' pack takes their scale group
    codes, scale, zero = quantize_w4(weight, group, spec.zero, act16_dtype(spec))
    k = weight.shape[1]
    return codes, expand_groups(scale, group, k), None if zero is None else expand_groups(zero, group, k)
