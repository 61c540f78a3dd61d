"""CPU fine-grained (unstructured) sparse linear ``Y = X · Wᵀ (+ b, activation)``: spec, packing, torch reference
(TVM-free). For highly sparse weights with no block structure; the kernel is ``fine.py``.

Dismantle levels:

* ``"full"``: the kept positions *and values* are baked into the code as constants (one
  FMA per non-zero; features with no kept weight leave no code);
* ``"tile"``: the kernel loops over features, reading each feature's range and its
  kept positions and values from compile-time lists passed with the kernel (code size
  independent of the weight).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .epilogue import torch_epilogue


@dataclass(frozen=True)
class FineLinearSpec:
    m: int                                  # rows of X; 0: any (the kernel takes M at run time)
    n: int
    k: int
    rows: tuple[tuple[int, ...], ...]   # kept input features of each output feature
    values: tuple[tuple[float, ...], ...] | None = None   # baked weights ("full" only)
    bias: bool = False
    activation: str | None = None
    accumulate: bool = False
    dismantle: str = "tile"
    name: str = "fine_linear"

    def __post_init__(self):
        if len(self.rows) != self.n:
            raise ValueError(f"spec {self.name}: rows must list {self.n} output features")
        if self.dismantle == "full" and self.values is None:
            raise ValueError(f"spec {self.name}: full dismantling bakes the values; give values")
        if self.dismantle not in ("full", "tile"):
            raise ValueError(f"spec {self.name}: unknown dismantle level {self.dismantle!r}")

    @property
    def nnz(self) -> int:
        return sum(len(r) for r in self.rows)

    def key(self) -> dict:
        return asdict(self)


def spec_from_weight(m, weight: torch.Tensor, mask: torch.Tensor, dismantle="tile", **kw) -> FineLinearSpec:
    rows = tuple(tuple(torch.nonzero(mask[i]).flatten().tolist()) for i in range(mask.shape[0]))
    values = None
    if dismantle == "full":
        w = weight.detach().to(torch.float32)
        values = tuple(tuple(float(w[i, j]) for j in r) for i, r in enumerate(rows))
    return FineLinearSpec(m, mask.shape[0], mask.shape[1], rows, values, dismantle=dismantle, **kw)


def pack(spec: FineLinearSpec, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    if spec.dismantle == "full":
        return {}
    mask = torch.zeros(spec.n, spec.k, dtype=torch.bool)
    for i, r in enumerate(spec.rows):
        mask[i, list(r)] = True
    idx = torch.nonzero(mask)[:, 1].to(torch.int32)
    vals = weight.detach().to(torch.float32)[mask]
    ptr = torch.zeros(spec.n + 1, dtype=torch.int32)
    ptr[1:] = torch.cumsum(mask.sum(1), 0)
    if not len(idx):
        idx, vals = torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    return {"I": idx.contiguous(), "V": vals.contiguous(), "P": ptr}


def dense_weight(spec: FineLinearSpec, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense (N, K) weight the kernel computes with."""
    w = torch.zeros(spec.n, spec.k)
    if spec.dismantle == "full":
        for i, (r, v) in enumerate(zip(spec.rows, spec.values)):
            if r:
                w[i, list(r)] = torch.tensor(v)
        return w
    rows = torch.repeat_interleave(torch.arange(spec.n), packed["P"][1:] - packed["P"][:-1])
    w[rows, packed["I"][: len(rows)].long()] = packed["V"][: len(rows)]
    return w


def reference(spec: FineLinearSpec, x: torch.Tensor, weight: torch.Tensor, bias=None, y=None) -> torch.Tensor:
    w = torch.zeros(spec.n, spec.k, dtype=torch.float64)
    for i, r in enumerate(spec.rows):
        if r:
            w[i, list(r)] = weight[i, list(r)].double()
    return torch_epilogue(spec, x.double() @ w.t(), bias, y)


def argument_names(spec: FineLinearSpec) -> list[str]:
    return ["X"] + (["I", "V", "P"] if spec.dismantle == "tile" else []) + (["B"] if spec.bias else []) + ["Y"]
