"""Calls of many rows on the vendor dense GEMM (``KernelChoice.dense_from``): where the plan prices a block-sparse
op's kernels above dense cuBLAS from some number of rows on (a 50% mask: the GEMV reads half the bytes at decode,
the tiles lose to cuBLAS at prefill), the op runs ``torch.nn.functional.linear`` over a dense copy of its kept
weight there, then the epilogue its kernels fuse (activation; gated unit) in torch. The copy is unpacked from the
packed blocks on their device at the first such call (outside any CUDA graph capture), so saved folders and
checkpoints carry the packed blocks only. A low-bit module keeps no copy: a dequantisation kernel (``dequant``)
writes the dense weight from its packed codes into a transient buffer at each such call, right before the GEMM.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..epilogue_ref import activate, gated
from ...runtime.cuda import CudaRuntimeError


class DenseRows:
    """Mixin of a 16-bit kernel module (:class:`~.runtime.SparseLinearCUDA`, the 2:4 ``NmLinearCUDA``):
    ``dense_from`` and the dense copy (a buffer, not saved). The module gives :meth:`packed_source` (the packed
    tensor a copy is made from: a new one makes a new copy) and :meth:`unpacked` (the dense (N, K) weight, gated:
    (2N, K), on that tensor's device); its ``spec`` has ``dtype``, ``act``, ``bias`` and maybe ``gate`` / ``out``.
    A low-bit module sets ``dequant_kinds`` = (spec class, launcher class) of its dequantisation kernel and gives
    ``dequant_fits(spec)``, ``dequantised(op)`` (the dense weight the launcher writes from the packed codes) and
    ``dequant_reference()`` (the same from the kernel's torch reference) for :meth:`attach_dequant`."""

    dequant_kinds: tuple | None = None

    def init_dense_rows(self, dense_from: int | None) -> None:
        if dense_from is not None and (self.spec.dtype not in ("float16", "bfloat16")
                                       or getattr(self.spec, "out", "") == "int8"):
            raise CudaRuntimeError(f"op {self.op_name!r}: only a 16-bit kernel writing 16-bit outputs runs its many-row "
                                   f"calls on the dense GEMM (dtype {self.spec.dtype})")
        self.dense_from = None if dense_from is None else int(dense_from)
        self.register_buffer("dense_w", None, persistent=False)
        self._dense_of = None
        self.dequant, self._dequant_op = None, None

    def attach_dequant(self, folder, spec, dense_from: int) -> None:
        """Run calls of ``dense_from`` rows or more on cuBLAS over the weight the kernel (``folder``, ``spec``)
        dequantises from the packed codes at each call (no copy kept)."""
        kinds = self.dequant_kinds
        if kinds is None or not isinstance(spec, kinds[0]) or not self.dequant_fits(spec) or int(dense_from) < 1 \
                or getattr(self.spec, "out", "") == "int8":
            raise CudaRuntimeError(f"op {self.op_name!r}: the dequantisation kernel {getattr(spec, 'name', spec)!r} "
                                   "does not write this op's packed weight, or its outputs are not 16-bit")
        self.dequant, self._dequant_op = (str(folder), spec), None
        self.dense_from, self.dense_w, self._dense_of = int(dense_from), None, None

    def dense_rows_call(self, x: torch.Tensor) -> torch.Tensor | None:
        """The op's output for ``x`` on the dense GEMM if its rows reach ``dense_from`` (else None)."""
        if self.dense_from is None or x.shape[0] < self.dense_from:
            return None
        if self.dequant is None:
            w = self._dense_weight()
        elif x.is_cuda:
            w = self._dequantised_now()
        else:                                  # on the CPU: what the kernel writes, from its torch reference
            w = self.dequant_reference()
        y = torch.nn.functional.linear(x, w.to(x.dtype), self.bias if self.spec.bias else None)
        if getattr(self.spec, "gate", False):          # in the input's dtype, as the model's own MLP computes it
            return gated(y, self.spec.act)
        return y if self.spec.act == "none" else activate(y, self.spec.act)

    def _dense_weight(self) -> torch.Tensor:
        source = self.packed_source()
        key = (source.data_ptr(), source.device)
        if self.dense_w is None or self._dense_of != key:
            if source.is_cuda and torch.cuda.is_current_stream_capturing():
                raise CudaRuntimeError(f"op {self.op_name!r}: its dense copy is built at the first call of "
                                       f"{self.dense_from}+ rows; run such a call once before capturing a CUDA graph")
            self.dense_w = self.unpacked()
            self._dense_of = key
        return self.dense_w

    def _dequantised_now(self) -> torch.Tensor:
        if self._dequant_op is None:
            self._dequant_op = self.dequant_kinds[1](*self.dequant)
        return self.dequantised(self._dequant_op)

    def dense_rows_repr(self) -> str:
        if self.dense_from is None:
            return ""
        what = "a weight dequantised per call" if self.dequant else "a dense copy"
        return f", cuBLAS on {what} from {self.dense_from} rows"

    def dense_rows_config(self) -> tuple[dict, dict[str, Path]]:
        """What a save records of the many-row path: (config entries, kernel folders)."""
        if self.dense_from is None:
            return {}, {}
        if self.dequant is None:
            return {"dense_from": self.dense_from}, {}
        folder, spec = Path(self.dequant[0]), self.dequant[1]
        return ({"dense_from": self.dense_from, "dequant": {"kernel": folder.name, "spec": dataclasses.asdict(spec)}},
                {folder.name: folder})

    @staticmethod
    def saved_dense_from(config: dict) -> int | None:
        """The constructor's ``dense_from`` from a saved ``config``: None where a dequantisation kernel comes with it
        (:meth:`restore_dequant` attaches both)."""
        return None if config.get("dequant") else config.get("dense_from")

    def restore_dequant(self, config: dict, folders: dict) -> None:
        """The saved dequantisation kernel of the many-row path, if the save has one."""
        from ...runtime.cuda import check_saved_spec
        entry = config.get("dequant")
        if not entry:
            return
        if self.dequant_kinds is None:
            raise CudaRuntimeError(f"op {self.op_name!r}: a saved dequantisation kernel on a module without one")
        spec = self.dequant_kinds[0](**entry["spec"])
        check_saved_spec(self.op_name, folders[entry["kernel"]], spec)
        self.attach_dequant(folders[entry["kernel"]], spec, config["dense_from"])


__all__ = ["DenseRows"]
