"""CPU fine-grained (unstructured) sparse linear ``Y = X · Wᵀ (+ b, activation)``.

For highly sparse weights with no block structure. Each parallel task transposes a
panel of ``PM`` rows of ``X`` into a workspace (so a column of ``X`` is contiguous),
then for every output feature accumulates ``w[n, k] · xᵀ[k, :]`` over that feature's kept
``k`` in a ``PM``-wide vector register tile.

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

from .epilogue import tir_activation, torch_epilogue

PM = 32  # rows per panel: the vector tile


@dataclass(frozen=True)
class FineLinearSpec:
    m: int
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


def fine_linear(spec: FineLinearSpec):
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    nnz = max(spec.nnz, 1)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(spec.name)
            T.func_attr({"tirx.noalias": True})
            X = T.arg("X", T.buffer((spec.m, spec.k), "float32"))
            tile = spec.dismantle == "tile"
            idx = T.arg("I", T.buffer((nnz,), "int32")) if tile else None
            val = T.arg("V", T.buffer((nnz,), "float32")) if tile else None
            ptr = T.arg("P", T.buffer((spec.n + 1,), "int32")) if tile else None
            B = T.arg("B", T.buffer((spec.n,), "float32")) if spec.bias else None
            Y = T.arg("Y", T.buffer((spec.m, spec.n), "float32"))

            def panel(m0, pm):
                xt = T.alloc_buffer((spec.k, pm), "float32", scope="global")
                acc = T.alloc_buffer((pm,), "float32", scope="global")
                with T.serial(0, spec.k) as kk:
                    with T.vectorized(0, pm) as v:
                        T.buffer_store(xt, X[m0 + v, kk], [kk, v])
                def feature(i, accumulate_terms):
                    with T.vectorized(0, pm) as v:
                        T.buffer_store(acc, tirx.const(0.0, "float32"), [v])
                    accumulate_terms()
                    with T.serial(0, pm) as v:
                        out = acc[v]
                        if spec.accumulate:
                            out = out + Y[m0 + v, i]
                        if spec.bias:
                            out = out + B[i]
                        T.buffer_store(Y, tir_activation(spec.activation, out), [m0 + v, i])

                if tile:
                    with T.serial(0, spec.n) as i:
                        def terms():
                            with T.serial(ptr[i], ptr[i + 1]) as t:
                                with T.vectorized(0, pm) as v:
                                    T.buffer_store(acc, acc[v] + val[t] * xt[idx[t], v], [v])
                        feature(i, terms)
                    return
                for i, row in enumerate(spec.rows):
                    def baked(i=i, row=row):
                        for j, w in zip(row, spec.values[i]):
                            with T.vectorized(0, pm) as v:
                                T.buffer_store(acc, acc[v] + tirx.const(w, "float32") * xt[j, v], [v])
                    feature(i, baked)

            panels = spec.m // PM
            if panels:
                with T.parallel(0, panels) as po:
                    panel(po * PM, PM)
            if spec.m % PM:
                panel(panels * PM, spec.m % PM)
    return ib.get()


def argument_names(spec: FineLinearSpec) -> list[str]:
    return ["X"] + (["I", "V", "P"] if spec.dismantle == "tile" else []) + (["B"] if spec.bias else []) + ["Y"]
