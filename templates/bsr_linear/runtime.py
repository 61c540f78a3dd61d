"""The graph module of a block-sparse linear on sparta's CUDA ``bsr_linear`` kernels (no TVM needed):
:class:`SparseLinearCUDA`, what ``compile(target="cuda")`` puts in place of a sparse linear; it holds the packed
weights, picks the kernel per call by its rows, and saves/loads without TVM. The launchers are in ``launchers.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .int4_records import pack_w4, unpack_w4
from .launchers import (BsrGemvOp, BsrLinearOp, _expanded_w4, _saved_gemv, gemv_fits, load_spec, spec_from_json,
                        spec_to_json)
from .packing import pack_weight, table_block_mask, unpack_weight
from .spec import BsrSpec
from ..quant.spec import quantize_rows
from ..w4a16_gemv.dequant import W4DequantOp, W4DequantSpec, dequant_ref
from ..w4a16_gemv.spec import W4A16Spec
from ...runtime.cuda import CudaRuntimeError, GraphWeightLayout, act16_dtype, check_saved_spec, device_arch
from .dense_rows import DenseRows
from .few_rows import GEMV_BUFFERS, FewRowGemvs
from ...runtime.ops import KernelModule
from ..quant.runtime import QuantizedLinear, RowQuantizer


class SparseLinearCUDA(DenseRows, FewRowGemvs, QuantizedLinear, GraphWeightLayout, KernelModule):
    """One graph op run by its ``bsr_linear`` kernel: packed blocks, table and bias as buffers.

    Called with the op's input (any float dtype, on a GPU); returns the op's output in the
    input's dtype. ``folder`` is the kernel's artifact folder (cubins + launch.json). A W8A8
    kernel (``spec.dtype == "int8"``) holds int8 blocks and per-channel ``weight_scale``; its
    input is quantised per token by the kernel in ``quant_folder`` (torch ops without one).
    ``hopper`` = (folder, spec): a ``wgmma`` kernel over the same blocks, run instead on sm_90 GPUs.
    ``gemv`` = (folder, spec): the few-row GEMV over the same blocks, run instead for inputs of up to ``spec.rows``
    rows (16-bit kernels); ``gemv1`` likewise, built for one row, run for one-row inputs. ``buckets`` = [(max rows, folder, spec), ...] in increasing rows: tile kernels over the same
    blocks with smaller M tiles, each run for inputs of up to its rows that the GEMV does not take (kernels of any M).
    A W4A16 or W8A8 kernel of any M may carry low-bit GEMVs for its few-row calls (:class:`FewRowGemvs`); a 16-bit
    one may run calls of ``dense_from`` rows or more on cuBLAS over a dense copy (:class:`DenseRows`).
    A W4A16 kernel holds int4 block records (scales and zero points inside ``wp``). After
    :meth:`requantize_output` it returns the int8 codes of its output at one static scale and that scale
    per row (what the W8A8 linears reading it take), as the graph tensors ``output_names``. The kernel runs as the
    op ``sparta::bsr_linear``.
    """

    kernel_family = "bsr_linear"
    weight_names = ("wp", "table", "bias", "weight_scale", *GEMV_BUFFERS)
    dequant_kinds = (W4DequantSpec, W4DequantOp)      # a W4A16 op's many-row calls: its GEMVs' codes dequantised

    def __init__(self, op_name: str, x_name: str, folder: str, spec: BsrSpec, wp: torch.Tensor,
                 table: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple,
                 weight_scale: torch.Tensor | None = None, quant_folder: str | None = None,
                 hopper: tuple | None = None, gemv: tuple | None = None, buckets=(), gemv1: tuple | None = None,
                 dense_from: int | None = None):
        super().__init__()
        self.op_name, self.input_names, self.folder, self.spec = op_name, [x_name], str(folder), spec
        self.init_few_rows()
        self.init_dense_rows(dense_from)
        self.hopper = None
        if hopper is not None:
            h_folder, h_spec = hopper
            same = ("m", "n", "k", "bn", "bk", "bias", "act", "dtype", "table", "gate")
            if h_spec.mma != "wgmma" or any(getattr(h_spec, f) != getattr(spec, f) for f in same):
                raise CudaRuntimeError(f"op {op_name!r}: the Hopper kernel must be a wgmma kernel over the same "
                                       f"blocks and epilogue ({', '.join(same)})")
            self.hopper = (str(h_folder), h_spec)
        self.gemv = None
        if gemv is not None:
            if not gemv_fits(spec, gemv[1]):
                raise CudaRuntimeError(f"op {op_name!r}: the GEMV must read the fp16 kernel's blocks and table and "
                                       "compute its epilogue")
            self.gemv = (str(gemv[0]), gemv[1])
        self.gemv1 = None
        if gemv1 is not None:
            if gemv is None or gemv1[1].rows != 1 or not gemv_fits(spec, gemv1[1]):
                raise CudaRuntimeError(f"op {op_name!r}: the one-row GEMV must be built for one row and read the fp16 "
                                       "kernel's blocks and table beside its few-row GEMV")
            self.gemv1 = (str(gemv1[0]), gemv1[1])
        self.buckets = [(int(top), str(folder), b) for top, folder, b in buckets]
        same = ("n", "k", "bn", "bk", "bias", "act", "dtype", "table", "groups", "out", "gate")
        if any(b.m != 0 or spec.m != 0 or any(getattr(b, f) != getattr(spec, f) for f in same) for _, _, b in
               self.buckets) or [t for t, _, _ in self.buckets] != sorted({t for t, _, _ in self.buckets}):
            raise CudaRuntimeError(f"op {op_name!r}: the kernels per bucket of rows must take any M, read the same "
                                   f"blocks and compute the same epilogue ({', '.join(same)}), in increasing rows")
        int8 = spec.dtype == "int8"
        if int8 and (wp.dtype != torch.int8 or weight_scale is None):
            raise CudaRuntimeError(f"op {op_name!r}: a W8A8 kernel needs int8 blocks and per-channel weight scales")
        if spec.dtype == "w4a16" and wp.dtype != torch.uint8:
            raise CudaRuntimeError(f"op {op_name!r}: a W4A16 kernel needs uint8 int4 block records")
        act = act16_dtype(spec)
        self.register_buffer("wp", wp if int8 or spec.dtype == "w4a16" else wp.to(act))
        self.register_buffer("weight_scale", weight_scale.float() if int8 else None)
        self.quant_folder = str(quant_folder) if quant_folder else None
        self.register_buffer("table", table.to(torch.int32))
        self.register_buffer("bias", bias.to(act) if bias is not None else torch.zeros(spec.weight_rows, dtype=act))
        self.out_shape = tuple(out_shape)
        self.weight_name, self.weight_transposed = None, False    # the graph weight it stands for
        self.out_dtype = None       # set when the input arrives quantised (use_quantized_input)
        self.output_names, self.out_scale = None, None     # set by requantize_output
        self._op = None
        self._ops = {}              # the GEMVs' and bucket tiles' launchers, by kernel folder
        self.register_kernel(op_name)

    @property
    def reads_int8(self) -> bool:
        return self.spec.dtype == "int8"

    def requantize_output(self, names: list[str], scale: float, kernel: tuple | None = None,
                          hopper: tuple | None = None, few_rows: list | None = None) -> None:
        """Return the int8 codes of the output at the static ``scale`` and that scale per row, as the graph
        tensors ``names`` (codes, scales), instead of the output. ``kernel`` / ``hopper`` = (folder, spec):
        the same kernels built with ``out="int8"`` (default: the current ones already are); ``few_rows``: the
        few-row GEMVs so built (default: kept if they already write codes, else dropped)."""
        if kernel is not None:
            self.folder, self.spec = str(kernel[0]), kernel[1]
        if hopper is not None:
            self.hopper = (str(hopper[0]), hopper[1])
        specs = [self.spec] + ([self.hopper[1]] if self.hopper else [])
        if any(s.out != "int8" for s in specs):
            raise CudaRuntimeError(f"op {self.op_name!r}: requantising needs kernels built with out='int8'")
        self.gemv, self.gemv1, self.buckets = None, None, []   # the GEMVs and bucket kernels write 16-bit outputs
        self.dense_from = None                                  # and so does the dense GEMM
        if few_rows is not None or any(g.out != "int8" for _, _, g in self.few_rows):
            self.requantize_few_rows(few_rows)
        self._requantized(names, scale, self.spec.m, self.wp.device)

    def write_gated(self, name: str) -> None:
        """A gated kernel's output is the graph tensor ``name`` (the product ``act(gate) · up``), not the op's own
        ``(M, 2N)`` output, which no kernel writes."""
        if not self.spec.gate:
            raise CudaRuntimeError(f"op {self.op_name!r}: only a gated kernel writes act(gate) * up")
        self.output_names = [name]

    @classmethod
    def from_weight(cls, op_name: str, x_name: str, folder, spec: BsrSpec, weight: torch.Tensor,
                    block_mask: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple,
                    weight_scale: torch.Tensor | None = None, quant_folder=None, hopper=None,
                    gemv=None, buckets=(), gemv1=None, dense_from=None) -> SparseLinearCUDA:
        """Pack ``weight`` (N, K); W8A8 kernels quantise it per channel (``weight_scale``: fitted
        scales, e.g. by calibration; default: each channel's absolute maximum / 127). W4A16 kernels
        round it to nearest in groups of 128 (fitted codes and scales: :meth:`from_w4_codes`)."""
        if spec.dtype == "w4a16":
            if weight_scale is not None:
                raise CudaRuntimeError(f"op {op_name!r}: give a W4A16 kernel fitted codes through from_w4_codes")
            return cls.from_w4_codes(op_name, x_name, folder, spec, *_expanded_w4(weight, 128, spec), block_mask,
                                     bias, out_shape)
        if spec.dtype == "int8":
            if weight_scale is None:
                codes, weight_scale = quantize_rows(weight)
            else:
                codes = torch.round(weight.float() / weight_scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
            wp, table = pack_weight(codes, spec, block_mask)
        else:
            wp, table = pack_weight(weight.to(act16_dtype(spec)), spec, block_mask)
        return cls(op_name, x_name, folder, spec, wp, table, bias, out_shape, weight_scale, quant_folder, hopper, gemv,
                   buckets, gemv1, dense_from)

    @classmethod
    def from_w4_codes(cls, op_name: str, x_name: str, folder, spec: BsrSpec, codes: torch.Tensor,
                      scale: torch.Tensor, zero: torch.Tensor | None, block_mask: torch.Tensor,
                      bias: torch.Tensor | None, out_shape: tuple) -> SparseLinearCUDA:
        """A W4A16 op from element-wise ``(N, K)`` uint8 codes (0..15), scales and zero points (None:
        symmetric, code 8 is zero), e.g. the ones calibration fitted."""
        wp, table = pack_w4(codes, scale.to(act16_dtype(spec)), zero, spec, block_mask)
        return cls(op_name, x_name, folder, spec, wp, table, bias, out_shape)

    def kernel_for(self, device) -> tuple[str, BsrSpec]:
        """(folder, spec) of the kernel this op runs on ``device``: the wgmma one on sm_90 if built."""
        if self.hopper is not None and device_arch(device) == "sm_90":
            return self.hopper
        return self.folder, self.spec

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The kernel on ``[x (M, K) fp16]`` or ``[codes (M, K) int8, scales (M,)]``: ``[(M, N) fp16 or int8]``."""
        x = inputs[0]
        if not x.is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r} was compiled for CUDA; move the model and inputs to a GPU "
                                   "(compiled.to('cuda'))")
        if self._op is None or self._op.wp.data_ptr() != self.wp.data_ptr():
            if not self.wp.is_cuda:
                raise CudaRuntimeError(f"op {self.op_name!r}: its weights are on the CPU; call compiled.to('cuda')")
            folder, spec = self.kernel_for(x.device)
            self._op = BsrLinearOp.packed(folder, spec, self.wp, self.table, self.bias, self.weight_scale,
                                          self.out_scale_os if self.out_scale is not None else None)
            if self.quant_folder:
                self._op.quantizer = RowQuantizer(self.quant_folder)
        if self.few_rows and (out := self.few_rows_call(inputs)) is not None:
            return out
        if len(inputs) == 2:
            return [self._op.int8(x.contiguous(), inputs[1])]
        if (y := self.dense_rows_call(x)) is not None:
            return [y]
        rows = x.shape[0]
        gemv = self.gemv1 if self.gemv1 is not None and rows == 1 else \
            self.gemv if self.gemv is not None and rows <= self.gemv[1].rows else None
        if gemv is not None:
            return [self._packed_op(gemv[0], lambda: BsrGemvOp(*gemv, self.wp, self.table, self.bias))(x.contiguous())]
        bucket = next((b for b in self.buckets if rows <= b[0]), None)
        if bucket is not None:
            _, folder, spec = bucket
            op = self._packed_op(str(folder), lambda: BsrLinearOp.packed(folder, spec, self.wp, self.table, self.bias))
            return [op(x.contiguous())]
        return [self._op(x.contiguous())]

    def _packed_op(self, key: str, make):
        """The launcher ``make()`` builds for kernel ``key`` over the packed weights (built again once they moved)."""
        op = self._ops.get(key)
        if op is None or op.wp.data_ptr() != self.wp.data_ptr():
            op = self._ops[key] = make()
        return op

    def packed_source(self) -> torch.Tensor:
        return self.wp

    def dequant_fits(self, spec: W4DequantSpec) -> bool:
        """Whether ``spec`` dequantises the W4A16 GEMVs' packed weight of this (not gated) op."""
        g = next((g for _, _, g in self.few_rows if isinstance(g, W4A16Spec)), None)
        return g is not None and not self.spec.gate and spec == W4DequantSpec.for_gemv(g)

    def dequantised(self, op: W4DequantOp) -> torch.Tensor:
        return op(*self.w4_pack())

    def dequant_reference(self) -> torch.Tensor:
        return dequant_ref(*self.w4_pack(), self.dequant[1])

    def unpacked(self) -> torch.Tensor:
        """The 16-bit kept blocks as the dense (N, K) weight (gated: (2N, K)) on their device (:class:`DenseRows`)."""
        return unpack_weight(self.wp, self.table, self.spec)

    def dense_weight(self) -> torch.Tensor:
        """The ``(N, K)`` 16-bit weight the kernel applies (pruned blocks zero; W8A8: dequantised; gated: ``(2N, K)``,
        the gate's rows then the up's), on the CPU."""
        if self.spec.dtype == "w4a16":
            return unpack_w4(self.wp.cpu(), self.table.cpu(), self.spec)
        w = unpack_weight(self.wp.cpu(), self.table.cpu(), self.spec)
        if self.spec.dtype == "int8":
            return (w.float() * self.weight_scale.cpu()[:, None]).to(act16_dtype(self.spec))
        return w

    def dense_codes(self) -> torch.Tensor:
        """The ``(N, K)`` int8 codes of a W8A8 kernel's blocks (pruned blocks zero), on the CPU."""
        if self.spec.dtype != "int8":
            raise CudaRuntimeError(f"op {self.op_name!r}: only a W8A8 kernel holds int8 codes")
        return unpack_weight(self.wp.cpu(), self.table.cpu(), self.spec)

    # ---- saved models (sparta.saved) ------------------------------------------------
    plan_tensors = ("table",)       # what a kernels-only save keeps: the block table (the mask), not the values

    def repack(self, graph, op_plan) -> None:
        """Pack the graph's weight and bias again as the build does (``from_weight`` / ``from_w4_codes`` over the
        blocks of the saved table; the few-row GEMVs' codes too): a checkpoint's values for the same kernels."""
        from ...codegen.cuda_bind import gemm_parts
        from ..w4a16_gemv.spec import w4_codes
        from ..w8a8_gemv.spec import int8_weight_scale
        parts = gemm_parts(graph, graph.op(self.op_name), op_plan)
        weight, bias, k, spec = parts.site.weight, parts.bias, self.spec.k, self.spec
        args = (self.op_name, self.input_names[0], self.folder, spec)
        mask = table_block_mask(self.table, spec)
        if spec.dtype == "w4a16":
            w4 = op_plan.weight_quant[4].params(weight)
            scale, zero = w4.expand(k)
            codes = w4_codes(w4, weight)                  # once: the tile kernel's records and the GEMVs' words
            fresh = SparseLinearCUDA.from_w4_codes(*args, codes, scale, zero, mask, bias, self.out_shape)
            if self.few_rows:
                group = self.few_rows[0][2].group
                fresh.attach_w4_gemvs(list(self.few_rows), codes, scale[:, ::group],
                                      None if zero is None else zero[:, ::group].to(torch.uint8))
        else:
            scale = int8_weight_scale(op_plan, weight, k) if spec.dtype == "int8" else None
            fresh = SparseLinearCUDA.from_weight(*args, weight, mask, bias, self.out_shape, weight_scale=scale)
            if self.few_rows:
                fresh.attach_w8_gemvs(list(self.few_rows), fresh.dense_codes())
        for name in self.weight_names:
            self._buffers[name] = fresh._buffers.get(name)
        self._op, self._ops, self._few_ops, self.dense_w = None, {}, {}, None

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        folder = Path(self.folder)
        config = {"op_name": self.op_name, "x_name": self.input_names[0], "out_shape": list(self.out_shape),
                  "spec": spec_to_json(self.spec), "kernel": folder.name, "weight_name": self.weight_name,
                  "weight_transposed": self.weight_transposed}
        tensors, folders = {"wp": self.wp, "table": self.table, "bias": self.bias}, {folder.name: folder}
        if self.weight_scale is not None:
            tensors["weight_scale"] = self.weight_scale
        inputs, quant_folders = self.input_config()
        config.update(inputs)
        folders.update(quant_folders)
        if self.hopper is not None:
            h_folder = Path(self.hopper[0])
            config["hopper"] = {"kernel": h_folder.name, "spec": spec_to_json(self.hopper[1])}
            folders[h_folder.name] = h_folder
        for key, gemv in (("gemv", self.gemv), ("gemv1", self.gemv1)):
            if gemv is not None:
                g_folder = Path(gemv[0])
                config[key] = {"kernel": g_folder.name, "spec": dataclasses.asdict(gemv[1])}
                folders[g_folder.name] = g_folder
        if self.buckets:
            config["buckets"] = [{"rows": top, "kernel": Path(f).name, "spec": spec_to_json(b)}
                                 for top, f, b in self.buckets]
            folders.update({Path(f).name: Path(f) for _, f, _ in self.buckets})
        config.update(self.output_config())
        few, few_folders = self.few_rows_config()
        config.update(few)
        folders.update(few_folders)
        tensors.update(self.few_rows_tensors())
        if self.spec.gate:
            config["gated_output"] = self.output_names[0]
        dense, dense_folders = self.dense_rows_config()
        config.update(dense)
        folders.update(dense_folders)
        return config, tensors, folders

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> SparseLinearCUDA:
        spec = spec_from_json(config["spec"])
        hopper = config.get("hopper")
        kernels = [(config["kernel"], spec)] + ([(hopper["kernel"], spec_from_json(hopper["spec"]))] if hopper else [])
        for name, kspec in kernels:
            check_saved_spec(config["op_name"], folders[name], kspec, load=load_spec)
        gemv, gemv1 = (_saved_gemv(config, key, folders) for key in ("gemv", "gemv1"))
        buckets = [(b["rows"], folders[b["kernel"]], spec_from_json(b["spec"])) for b in config.get("buckets", ())]
        for _, folder, bspec in buckets:
            check_saved_spec(config["op_name"], folder, bspec, load=load_spec)
        module = cls(config["op_name"], config["x_name"], folders[config["kernel"]], spec, tensors["wp"],
                     tensors["table"], tensors["bias"], tuple(config["out_shape"]), tensors.get("weight_scale"),
                     folders[config["quantizer"]] if config.get("quantizer") else None,
                     (folders[kernels[1][0]], kernels[1][1]) if hopper else None, gemv, buckets, gemv1,
                     cls.saved_dense_from(config))
        module.weight_name, module.weight_transposed = config["weight_name"], config["weight_transposed"]
        module.restore_input(config)
        module.restore_few_rows(config, tensors, folders)
        module.restore_dequant(config, folders)
        module.restore_output(config)
        if spec.gate:
            module.write_gated(config["gated_output"])
        return module

    def extra_repr(self) -> str:
        return (f"{self.op_name}: {self.spec.k}->{self.spec.n}, {self.spec.bn}x{self.spec.bk} blocks, "
                f"{ {'int8': 'W8A8', 'w4a16': 'W4A16', 'bfloat16': 'bf16'}.get(self.spec.dtype, 'fp16')}, act={self.spec.act}"
                f"{' (gated: act(gate) * up)' if self.spec.gate else ''}"
                f"{', wgmma on sm_90' if self.hopper else ''}"
                f"{', one-row GEMV' if self.gemv1 else ''}"
                f"{f', GEMV up to {self.gemv[1].rows} rows' if self.gemv else ''}{self.few_rows_repr()}"
                f"{''.join(f', tm {b.tm} up to {t} rows' for t, _, b in self.buckets)}{self.dense_rows_repr()}"
                f"{f', int8 codes out (scale {self.out_scale:.3g})' if self.out_scale is not None else ''}")


__all__ = ["BsrGemvOp", "BsrLinearOp", "SparseLinearCUDA", "gemv_fits", "load_spec", "spec_from_json", "spec_to_json"]
