"""Low-bit GEMVs beside a low-bit tile kernel, for the few-row calls of a graph of any number of rows (no TVM).

A W4A16 or W8A8 linear compiled for any rows (the default compile) runs its tile kernel's 128- or 64-row tiles, a
grid of a few dozen CTAs at decode. :class:`FewRowGemvs` is the part of
:class:`~sparta.templates.bsr_linear.runtime.SparseLinearCUDA` that holds the GEMVs of that op (``templates/w4a16_gemv/``,
``templates/w8a8_gemv/``, built for any M up to their ``rows``) and their packed weight — the same codes in the
GEMV's layout, or for a W4A16 tile that reads that layout itself (``BsrSpec.gemv_group``) the tile's own weight: one
pack — and runs the first whose rows hold the call's, as a static compile of that many rows would. A W8A8
op's GEMVs share its per-channel scales and bias, read the same per-token codes, and write int8 codes where the
op does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..quant.spec import quantize_rows
from ..w4a16_gemv.spec import W4A16Spec, flat_views, pack_codes, split_buffers
from ..w8a8_gemv.spec import W8A8GemvSpec, pack_weight
from ...runtime.cuda import CudaRuntimeError, check_saved_spec
from ..w4a16_gemv.runtime import W4A16GemvOp
from ..w8a8_gemv.runtime import W8A8GemvOp

GEMV_BUFFERS = ("gemv_wq", "gemv_scale", "gemv_zero", "gemv_table")


class FewRowGemvs:
    """Mixin of :class:`~sparta.templates.bsr_linear.runtime.SparseLinearCUDA`: ``few_rows`` = [(max rows, folder, spec), ...]
    in increasing rows, GEMVs over the buffers ``gemv_*``, each run for calls of up to its rows."""

    def init_few_rows(self) -> None:
        self.few_rows = []
        for name in GEMV_BUFFERS:
            self.register_buffer(name, None)
        self._few_ops = {}

    def attach_w4_gemvs(self, kernels: list, codes: torch.Tensor, scale: torch.Tensor,
                        zero: torch.Tensor | None) -> None:
        """W4A16 GEMVs over uint8 codes ``(N, K)`` (0..15), group scales and zero points ``(N, K / group)``; a tile
        kernel that reads the GEMVs' pack lends them its weight (the codes are not packed again)."""
        self._check_few_rows(kernels, W4A16Spec, "w4a16")
        if not self.spec.gemv_group:
            wq, s, z = pack_codes(codes, scale, zero, kernels[0][2])
            self.gemv_wq, self.gemv_scale, self.gemv_zero = wq, s.to(self.bias.dtype), z
        self.few_rows = [(int(t), str(f), spec) for t, f, spec in kernels]

    def w4_pack(self) -> tuple:
        """``(Wq, S, Z)`` the W4A16 GEMVs read: views of the tile's weight where it reads their pack, else their own
        buffers."""
        if self.spec.gemv_group:
            return flat_views(self.wp, self.few_rows[0][2])
        return self.gemv_wq, self.gemv_scale, self.gemv_zero

    def attach_w8_gemvs(self, kernels: list, codes: torch.Tensor) -> None:
        """W8A8 GEMVs over the int8 codes ``(N, K)`` of the op's own blocks (its scales and bias); GEMVs that read the
        tile's blocks (``W8A8GemvSpec.blocks``) take them as they are (nothing packed again)."""
        self._check_few_rows(kernels, W8A8GemvSpec, "int8")
        if not kernels[0][2].blocks:
            self.gemv_wq, self.gemv_table = pack_weight(kernels[0][2], codes)
        self.few_rows = [(int(t), str(f), spec) for t, f, spec in kernels]

    def w8_pack(self) -> tuple:
        """``(WQ, table)`` the W8A8 GEMVs read: the tile's blocks and table, or their own pack."""
        if self.few_rows[0][2].blocks:
            return self.wp, self.table
        return self.gemv_wq, self.gemv_table

    def _few_rows_source(self, w4: bool) -> torch.Tensor:
        """The tensor whose storage the GEMVs' weight starts at (what a launcher built before must still read)."""
        if w4:
            return self.wp if self.spec.gemv_group else self.gemv_wq
        return self.wp if self.few_rows[0][2].blocks else self.gemv_wq

    def _check_few_rows(self, kernels: list, spec_type, dtype: str) -> None:
        s = self.spec
        tops = [t for t, _, _ in kernels]
        same = {(g.n, g.k, g.bias, getattr(g, "sym", None), getattr(g, "group", None), getattr(g, "sparse", None))
                for _, _, g in kernels}
        ok = (s.dtype == dtype and s.m == 0 and kernels and tops == sorted(set(tops))
              and all(isinstance(g, spec_type) and g.m == 0 and g.max_rows >= t and (g.n, g.k) == (s.n, s.k)
                      and g.bias == s.bias for t, _, g in kernels) and len(same) == 1)
        if dtype == "int8":
            ok = ok and all(g.act == s.act and (g.out == "int8") == (s.out == "int8") for _, _, g in kernels)
            ok = ok and all((g.bn, g.bk) in ((0, 0), (s.bn, s.bk)) for _, _, g in kernels) and \
                len({g.blocks for _, _, g in kernels}) == 1 and not (kernels[0][2].blocks and s.groups)
        elif s.gemv_group:                 # the tile's pack is theirs: the same scale group, zero points and type
            ok = ok and all((g.group, g.sym, g.dtype) == (s.gemv_group, not s.zero, s.act16) for _, _, g in kernels)
        if not ok:
            raise CudaRuntimeError(f"op {self.op_name!r}: the few-row GEMVs must take any M up to their rows, read one "
                                   f"packed weight of the op's shape and compute its epilogue, in increasing rows")

    def requantize_few_rows(self, kernels: list | None) -> None:
        """The GEMVs built with ``out="int8"`` (None: the op's output is requantised and they are dropped)."""
        if kernels is None:
            self.few_rows, self.gemv_wq, self.gemv_table, self.gemv_scale, self.gemv_zero = [], None, None, None, None
        elif [t for t, _, _ in kernels] != [t for t, _, _ in self.few_rows] \
                or any(g.out != "int8" or dataclasses.replace(g, out=o.out, name=o.name) != o
                       for (_, _, g), (_, _, o) in zip(kernels, self.few_rows)):
            raise CudaRuntimeError(f"op {self.op_name!r}: requantised GEMVs must be the same GEMVs with out='int8'")
        else:
            self.few_rows = [(int(t), str(f), g) for t, f, g in kernels]
        self._few_ops = {}

    def few_rows_call(self, inputs: list[torch.Tensor]):
        """The op's output from the GEMV of the call's rows (a list), or None where the tile kernel runs."""
        rows = inputs[0].shape[0]
        entry = next((e for e in self.few_rows if rows <= e[0]), None)
        if entry is None:
            return None
        top, folder, spec = entry
        op = self._few_ops.get(top)
        w4 = isinstance(spec, W4A16Spec)
        if op is None or op.wq.data_ptr() != self._few_rows_source(w4).data_ptr():   # views only when (re)made
            if w4:
                wq, s, z = self.w4_pack()
                op = W4A16GemvOp(folder, spec, wq, s, z, self.bias if spec.bias else None, split_buffers(spec, wq.device))
            else:
                wq, table = self.w8_pack()
                op = W8A8GemvOp(folder, spec, wq, self.weight_scale, self.bias if spec.bias else None,
                                self.out_scale_os if spec.out == "int8" else None, table)
            self._few_ops[top] = op
        if isinstance(spec, W4A16Spec):
            return [op(inputs[0].contiguous())]
        if len(inputs) == 2:
            return [op(inputs[0].contiguous(), inputs[1])]
        quantizer = self._op.quantizer if self._op is not None and self._op.quantizer is not None else quantize_rows
        return [op(*quantizer(inputs[0].contiguous()))]

    def few_rows_config(self) -> tuple[dict, dict[str, Path]]:
        """What a save records of the GEMVs: (config entries, kernel folders)."""
        if not self.few_rows:
            return {}, {}
        return ({"few_rows": [{"rows": t, "kernel": Path(f).name, "spec": dataclasses.asdict(g)}
                              for t, f, g in self.few_rows]},
                {Path(f).name: Path(f) for _, f, _ in self.few_rows})

    def restore_few_rows(self, config: dict, tensors: dict, folders: dict) -> None:
        entries = config.get("few_rows")
        if not entries:
            return
        spec_type = W4A16Spec if self.spec.dtype == "w4a16" else W8A8GemvSpec
        kernels = [(e["rows"], folders[e["kernel"]], spec_type(**e["spec"])) for e in entries]
        for _, folder, spec in kernels:
            check_saved_spec(config["op_name"], folder, spec)
        self._check_few_rows(kernels, spec_type, self.spec.dtype)
        self.few_rows = [(int(t), str(f), g) for t, f, g in kernels]
        first = kernels[0][2]
        if self.spec.gemv_group or getattr(first, "blocks", False):     # the tile's weight is their pack
            return
        packed = [tensors.get(n) for n in GEMV_BUFFERS]
        want = (first.tiles, first.chunks, 32, 4) if spec_type is W4A16Spec else None
        if packed[0] is None or (want is not None and tuple(packed[0].shape) != want):
            raise CudaRuntimeError(f"op {config['op_name']!r}: the few-row GEMVs' packed weight is missing or "
                                   "misshapen")
        self.gemv_wq, self.gemv_scale, self.gemv_zero, self.gemv_table = packed

    def few_rows_tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in GEMV_BUFFERS if getattr(self, n) is not None}

    def few_rows_repr(self) -> str:
        return "".join(f", {'W4A16' if isinstance(g, W4A16Spec) else 'W8A8'} GEMV up to {t} rows"
                       for t, _, g in self.few_rows)


__all__ = ["FewRowGemvs", "GEMV_BUFFERS"]
