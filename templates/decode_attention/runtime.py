"""sparta's decode-attention kernels (``templates/decode_attention/``) from torch, without TVM.

``DecodeAttentionOp(partial_folder, combine_folder)(q, k, v, keep, scale)`` runs the two kernels on torch's current
stream: the partial kernel into an fp32 workspace allocated per call (``torch.empty`` on the inputs' device, so a CUDA
graph capture takes it from its pool), then the combine kernel into ``out``. :class:`DecodeAttentionCUDA` is the kernel
module: its op ``sparta::decode_attention`` (defined for every family in ``sparta/runtime/ops.py``) takes
``[q, k, v, keep]`` and the module's fp32 ``scale``, and has a fake implementation, so it runs inside
``torch.compile`` graphs and CUDA graph captures. A module built with the ``rope`` pair as well also runs a decode
step's rotary embedding and cache write in the same launches (:meth:`DecodeAttentionCUDA.rope_forward`, the op
``sparta::decode_attention_rope``, which declares the cache and its counter mutated).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .spec import DTYPES, DecodeAttentionError, DecodeAttentionSpec, check_inputs, check_rope_inputs, workspace_shapes
from ...runtime.cuda import CudaKernel, CudaRuntimeError, check_saved_spec, kernel_file, lanes16
from ...runtime.ops import KernelModule, outside_trace


def folder_spec(folder) -> DecodeAttentionSpec:
    """The spec a kernel folder was built from (its ``spec.json``)."""
    return DecodeAttentionSpec(**json.loads(kernel_file(folder, "spec.json")))


def check_pair(partial: DecodeAttentionSpec, combine: DecodeAttentionSpec) -> None:
    """Refuse two kernels that are not the partial and combine stages of one attention shape."""
    same = dataclasses.replace(combine, stage="partial", name=partial.name) == partial
    if partial.stage != "partial" or combine.stage != "combine" or not same:
        raise DecodeAttentionError(f"kernels {partial.name} ({partial.stage}) and {combine.name} ({combine.stage}) "
                                   "are not the partial and combine stages of one decode attention")


class DecodeAttentionOp:
    """Both kernels of one (Hq, Hkv, D, dtype), loaded from their folders; ``op(q, k, v, keep, scale)``."""

    def __init__(self, partial_folder, combine_folder):
        self.spec, combine = folder_spec(partial_folder), folder_spec(combine_folder)
        check_pair(self.spec, combine)
        self.partial, self.combine = CudaKernel(partial_folder), CudaKernel(combine_folder)
        self.dtype = DTYPES[self.spec.dtype]
        self._prepared = None
        self._scales: dict[tuple, torch.Tensor] = {}

    def scale_tensor(self, scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
        """``scale`` as the (1,) fp32 tensor on ``device`` the kernel reads (a float's tensor made once)."""
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
                raise DecodeAttentionError(f"decode attention {self.spec.name}: a scale tensor must be one fp32 value "
                                           f"on {device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")
            return scale.reshape(1)
        key = (device, float(scale))
        if key not in self._scales:
            self._scales[key] = torch.full((1,), float(scale), dtype=torch.float32, device=device)
        return self._scales[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                 scale: float | torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        """``rope`` (the ``rope`` kernels): ``(cos, sin, position)``; ``q`` is then the stacked projections ``qkv``
        (B, Hq + 2 Hkv, D) before the rotary embedding, and ``k``, ``v`` and ``position`` are written (the new key and
        value at ``position``, which gains one)."""
        b, s = check_inputs(self.spec, q, k, v, keep)
        if self.spec.rope != (rope is not None):
            raise DecodeAttentionError(f"decode attention {self.spec.name}: " + (
                "the rope kernels take (cos, sin, position)" if self.spec.rope else
                "these kernels apply no rotary embedding (build the rope pair)"))
        if rope is not None:
            check_rope_inputs(self.spec, q, *rope[:2], k, rope[2])
        if not q.is_cuda:
            raise CudaRuntimeError(f"decode attention {self.spec.name} runs on a CUDA GPU; q is on {q.device}")
        out = torch.empty(b, self.spec.hq, self.spec.d, dtype=self.dtype, device=q.device)
        if b == 0:
            return out
        ws = {name: torch.empty(shape, dtype=torch.float32, device=q.device)
              for name, shape in workspace_shapes(self.spec, b, s).items()}
        first = dict(Q=lanes16(q), K=lanes16(k), V=lanes16(v), KEEP=keep.view(torch.uint8),
                     SCALE=self.scale_tensor(scale, q.device), **ws)
        second = dict(**ws, Y=lanes16(out))
        if rope is not None:
            cos, sin, position = rope
            first.update(COS=lanes16(cos), SIN=lanes16(sin), POS=position.reshape(1))
            second["POS"] = position.reshape(1)
        if self._prepared is None or self._prepared[0].device != q.device.index:
            self._prepared = (self.partial.prepare(tuple(first), **first), self.combine.prepare(tuple(second), **second))
        else:
            self._prepared[0].launch(**first)
            self._prepared[1].launch(**second)
        return out


def _separate_projections(partial_folder) -> bool:
    """Whether a rope partial kernel was built to read the new key and value as inputs of their own (``KN``, ``VN``:
    before the stacked projections)."""
    try:
        launch = json.loads(kernel_file(partial_folder, "launch.json"))
    except (OSError, ValueError, CudaRuntimeError):
        return False                    # not a built folder: the module's own checks speak when it loads
    return any(isinstance(a, dict) and a.get("name") in ("KN", "VN") for a in launch.get("args", []))


class DecodeAttentionCUDA(KernelModule):
    """Decode attention on sparta's kernels (the op ``sparta::decode_attention``): ``module(q, k, v, keep)`` with
    ``q`` (B, Hq, D), ``k``, ``v`` (B, Hkv, S, D), ``keep`` (B, S) bool, at the softmax scale given at construction
    (default ``D ** -0.5``)."""

    kernel_family = "decode_attention"
    weight_names = ("scale",)

    def __init__(self, partial_folder, combine_folder, scale: float | None = None, op_name: str = "decode_attention",
                 rope_folders: tuple | None = None):
        super().__init__()
        self.spec = folder_spec(partial_folder)
        check_pair(self.spec, folder_spec(combine_folder))
        if self.spec.rope:
            raise DecodeAttentionError(f"{op_name}: the first pair is the plain one; rope kernels go in rope_folders")
        self.rope_folders = None
        if rope_folders is not None and _separate_projections(rope_folders[0]):
            import warnings
            warnings.warn(f"{op_name}: its rope kernels were built before they read the stacked projections; the decode "
                          "steps keep Hugging Face's rotary embedding and cache write (compile again to fuse them)",
                          stacklevel=2)
            rope_folders = None
        if rope_folders is not None:
            rope = [folder_spec(f) for f in rope_folders]
            check_pair(*rope)
            if not rope[0].rope or dataclasses.replace(rope[0], rope=False, name=self.spec.name) != self.spec:
                raise DecodeAttentionError(f"{op_name}: kernels {rope[0].name} are not the rope pair of {self.spec.name}")
            self.rope_folders = tuple(str(f) for f in rope_folders)
        self._rope_op = None
        self.partial_folder, self.combine_folder, self.op_name = str(partial_folder), str(combine_folder), op_name
        value = self.spec.d ** -0.5 if scale is None else float(scale)
        self._scale_value = value                   # read at trace time: no tensor read inside a compiled graph
        self.register_buffer("scale", torch.tensor([value], dtype=torch.float32))
        self._op = None
        self.register_kernel(op_name)

    @property
    def dtype(self) -> torch.dtype:
        """The 16-bit dtype of its inputs and output."""
        return DTYPES[self.spec.dtype]

    @property
    def scale_value(self) -> float:
        return self._scale_value

    @property
    def has_rope(self) -> bool:
        """Whether the module also holds the kernels of :meth:`rope_forward`."""
        return self.rope_folders is not None

    def rope_forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """A decode step's attention from its stacked projections ``qkv`` (B, Hq + 2 Hkv, D: the query heads, the new
        key, the new value) before the rotary embedding (``cos``, ``sin`` (B, D)); the rotated key and the value are
        stored into the cache ``k``, ``v`` at ``position`` (a (1,) int64 counter, which gains one), then attention
        over ``keep``."""
        if not self.has_rope:
            raise DecodeAttentionError(f"{self.op_name}: built without the rope kernels")
        inputs = [qkv, cos, sin, keep]
        if outside_trace((*inputs, k, v, position)):
            return self.launch_rope(inputs, k, v, position)
        return torch.ops.sparta.decode_attention_rope(self.kernel_key, inputs, k, v, position, self.kernel_weights())

    def launch_rope(self, inputs: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    position: torch.Tensor) -> torch.Tensor:
        qkv, cos, sin, keep = inputs
        return self._kernels(qkv, rope=True)(qkv, k, v, keep, self.scale, (cos, sin, position))

    def fake_rope(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return self.fake(inputs)[0]

    def _kernels(self, q: torch.Tensor, rope: bool) -> DecodeAttentionOp:
        """The plain or the rope pair, loaded on first use, for inputs on ``q``'s device (the scale moved there)."""
        if not q.is_cuda:
            raise CudaRuntimeError(f"op {self.op_name!r} was compiled for CUDA; move the module and inputs to a GPU "
                                   "(module.to('cuda'))")
        if self.scale.device != q.device:       # move the module first where a CUDA graph captures it
            self.scale = self.scale.to(q.device)
        if rope:
            if self._rope_op is None:
                self._rope_op = DecodeAttentionOp(*self.rope_folders)
            return self._rope_op
        if self._op is None:
            self._op = DecodeAttentionOp(self.partial_folder, self.combine_folder)
        return self._op

    @classmethod
    def from_folder(cls, root, name: str, scale: float | None = None) -> DecodeAttentionCUDA:
        """The module of the kernel folders ``root/<name>_partial`` and ``root/<name>_combine`` (and, where built,
        ``root/<name>_rope_partial`` and ``_rope_combine``)."""
        root = Path(root)
        rope = (root / f"{name}_rope_partial", root / f"{name}_rope_combine")
        rope = rope if all((f / "spec.json").is_file() for f in rope) else None
        return cls(root / f"{name}_partial", root / f"{name}_combine", scale, name, rope)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.call_kernel(q, k, v, keep)[0]

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        q, k, v, keep = inputs
        return [self._kernels(q, rope=False)(q, k, v, keep, self.scale)]

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        q = inputs[0]
        return [q.new_empty((q.shape[0], self.spec.hq, self.spec.d))]

    def saved_state(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, Path]]:
        partial, combine = Path(self.partial_folder), Path(self.combine_folder)
        config = {"op_name": self.op_name, "spec": self.spec.key(), "partial": partial.name,
                  "combine": combine.name, "scale": float(self.scale.reshape(-1)[0])}
        folders = {partial.name: partial, combine.name: combine}
        if self.has_rope:
            rope = [Path(f) for f in self.rope_folders]
            config["rope"] = [f.name for f in rope]
            folders.update({f.name: f for f in rope})
        return config, {}, folders

    @classmethod
    def from_saved(cls, config: dict, tensors: dict[str, torch.Tensor], folders: dict[str, Path]) -> DecodeAttentionCUDA:
        spec = DecodeAttentionSpec(**config["spec"])
        partial, combine = folders[config["partial"]], folders[config["combine"]]
        check_saved_spec(config["op_name"], partial, spec)
        rope = tuple(folders[name] for name in config["rope"]) if config.get("rope") else None
        return cls(partial, combine, float(config["scale"]), config["op_name"], rope)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"{self.op_name}: Hq={s.hq}, Hkv={s.hkv}, D={s.d}, {s.dtype}, {s.chunk} keys a split, "
                f"scale={float(self.scale.reshape(-1)[0]):.6g}{', rotary and cache write fused' if self.has_rope else ''}")


__all__ = ["DecodeAttentionCUDA", "DecodeAttentionOp", "check_pair", "folder_spec"]
