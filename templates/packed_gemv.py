"""What the few-row GEMV families share (``bitmap_gemv``, ``fp8_gemv``, ``nm_linear``): the launcher of one kernel over
one packed weight (:class:`PackedGemvOp`: x checked, Y made, the launch prepared once and then rebound to new X/Y),
and the kernel module over it (:class:`PackedGemvModule`: ``forward`` flattens the leading dimensions into M and
back, ``launch`` makes the launcher again whenever the packed buffers moved (``.to``, a repack), with the split-K
workspace buffers (``split_P``, ``split_Cnt``) where ``spec.ksplit > 1``, and ``fake`` gives the output's shape), and
for one standing for an op of a compiled graph :class:`GraphGemv` (its input, output shape, the weight it stands for,
and its many-row calls on the dense GEMM)."""

from __future__ import annotations

import torch

from ..runtime.cuda import CudaKernel, CudaRuntimeError, lanes16
from .bsr_linear.dense_rows import DenseRows


class PackedGemvOp:
    """The kernel of ``folder`` on device tensors: ``op(x)`` for a contiguous ``(M, K)`` x of the spec's dtype,
    ``M <= spec.rows``; ``split``: the ``ksplit > 1`` workspace (made here if not given); ``kernel``: the folder's
    loaded :class:`CudaKernel`, to share one between ops of several weights. A family sets ``label`` (its name in
    errors), ``error`` (its error class), ``check`` and ``split_buffers`` (its spec module's), ``align_x`` (X rows
    read in 16-byte pieces: an unaligned X is copied) and :meth:`weights` (the packed weight's launch arguments)."""

    label, error, align_x = "", CudaRuntimeError, False
    check = split_buffers = None

    def __init__(self, folder, spec, packed, bias: torch.Tensor | None, split: dict | None = None,
                 kernel: CudaKernel | None = None):
        type(self).check(spec, packed, bias)
        self.kernel = CudaKernel(folder) if kernel is None else kernel
        self.spec, self.packed, self.bias = spec, packed, bias
        device = next(t for t in vars(packed).values() if isinstance(t, torch.Tensor)).device
        self.split = type(self).split_buffers(spec, device) if split is None else split
        self._prepared = None

    def weights(self) -> dict:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        s, what = self.spec, f"{self.label} {self.spec.name}"
        if x.dim() != 2 or x.shape[1] != s.k or x.dtype != getattr(torch, s.dtype) or not x.is_contiguous():
            raise self.error(f"{what}: x must be a contiguous {s.dtype} (M, {s.k}) tensor, got {x.dtype} "
                             f"{tuple(x.shape)}")
        if x.shape[0] > s.rows:
            raise self.error(f"{what}: at most {s.rows} rows a call, got {x.shape[0]}")
        if not x.is_cuda:
            raise CudaRuntimeError(f"{what} runs on a CUDA GPU; x is on {x.device}")
        y = torch.empty(x.shape[0], s.n, dtype=x.dtype, device=x.device)
        if x.shape[0] == 0:                    # no rows: nothing to launch
            return y
        if self.align_x and s.k % 8 == 0 and x.data_ptr() % 16:
            x = x.clone()                      # the kernel reads X rows in 16-byte pieces
        if self._prepared is None:
            self._prepared = self.kernel.prepare(("X", "Y"), X=lanes16(x), Y=lanes16(y), **self.weights(),
                                                 **({"B": lanes16(self.bias)} if s.bias else {}), **self.split)
        else:
            self._prepared.launch(X=lanes16(x), Y=lanes16(y))
        return y


class PackedGemvModule:
    """Mixin before ``KernelModule``. The module has ``spec`` (``n``, ``k``, ``dtype``, ``ksplit``), ``folder``,
    ``op_name``, ``bias``, ``packed`` and sets ``op_class`` (its launcher: ``op_class(folder, spec, packed, bias,
    split)``) and ``packed_names`` (the buffers a launcher reads); ``_op`` starts None."""

    op_class = None
    packed_names: tuple[str, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = getattr(torch, self.spec.dtype)
        (y,) = self.call_kernel(x.reshape(-1, self.spec.k).to(dtype).contiguous())
        return y.reshape(*x.shape[:-1], self.spec.n).to(x.dtype)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        x = inputs[0]
        buffers = [getattr(self, n) for n in self.packed_names]
        if not x.is_cuda or not buffers[0].is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r} was compiled for CUDA; move the module and inputs to a GPU "
                                   "(module.to('cuda'))")
        key = tuple(b.data_ptr() for b in buffers)
        if self._op is None or getattr(self, "_op_key", None) != key:
            split = {"P": self.split_P, "Cnt": self.split_Cnt} if self.spec.ksplit > 1 else {}
            self._op, self._op_key = self.op_class(self.folder, self.spec, self.packed, self.bias, split), key
        return [self._op(x)]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        x = inputs[0]
        return [x.new_empty((x.shape[0], self.spec.n), dtype=getattr(torch, self.spec.dtype))]


class GraphGemv(DenseRows):
    """Mixin before :class:`PackedGemvModule` of a module standing for op ``op_name`` of a compiled graph: it reads the
    graph tensor ``x_name``, its output has ``out_shape`` at the example, it stands for the graph weight
    ``weight_name`` (``codegen.cuda_bind.bind``), and calls of ``dense_from`` rows or more run cuBLAS over a dense
    copy (:class:`DenseRows`; the module gives ``packed_source`` and ``unpacked``)."""

    def init_graph(self, x_name: str | None, out_shape, dense_from: int | None) -> None:
        self.input_names = None if x_name is None else [x_name]
        self.output_names, self.out_shape = None, None if out_shape is None else tuple(out_shape)
        self.weight_name, self.weight_transposed = None, False
        self.init_dense_rows(dense_from)

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if inputs[0].is_cuda and self.packed_source().is_cuda and (y := self.dense_rows_call(inputs[0])) is not None:
            return [y]
        return PackedGemvModule.launch(self, inputs)

    def graph_config(self) -> dict:
        """What a save keeps of the graph fields (nothing for a module built outside a graph)."""
        if self.input_names is None:
            return {}
        return dict(x_name=self.input_names[0], out_shape=list(self.out_shape), **self.dense_rows_config()[0],
                    weight_name=self.weight_name, weight_transposed=self.weight_transposed)

    @staticmethod
    def graph_args(config: dict) -> dict:
        """The constructor's graph arguments from a saved ``config``."""
        return dict(x_name=config.get("x_name"), out_shape=config.get("out_shape"),
                    dense_from=DenseRows.saved_dense_from(config))

    def restore_graph(self, config: dict):
        """The weight a loaded module stands for, from its saved ``config``; returns the module."""
        self.weight_name = config.get("weight_name")
        self.weight_transposed = bool(config.get("weight_transposed", False))
        return self


__all__ = ["GraphGemv", "PackedGemvModule", "PackedGemvOp"]
