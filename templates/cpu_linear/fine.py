"""The CPU fine-grained sparse linear (``fine_spec.FineLinearSpec``) as a TIR template, built with LLVM.

Each parallel task transposes a panel of ``PM`` rows of ``X`` into a workspace (so a column of ``X`` is contiguous),
then for every output feature accumulates ``w[n, k] · xᵀ[k, :]`` over that feature's kept ``k`` in a ``PM``-wide
vector register tile.
"""

from __future__ import annotations

from .epilogue import tir_activation
from .fine_spec import FineLinearSpec

PM = 32  # rows per panel: the vector tile


def fine_linear(spec: FineLinearSpec):
    """The PrimFunc of ``spec``; arguments in ``fine_spec.argument_names(spec)`` order."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    nnz = max(spec.nnz, 1)
    symbolic = spec.m == 0                 # any number of rows: M is an argument of the kernel
    m = tirx.Var("m", "int32") if symbolic else spec.m
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(spec.name)
            T.func_attr({"tirx.noalias": True})
            X = T.arg("X", T.buffer((m, spec.k), "float32"))
            tile = spec.dismantle == "tile"
            idx = T.arg("I", T.buffer((nnz,), "int32")) if tile else None
            val = T.arg("V", T.buffer((nnz,), "float32")) if tile else None
            ptr = T.arg("P", T.buffer((spec.n + 1,), "int32")) if tile else None
            B = T.arg("B", T.buffer((spec.n,), "float32")) if spec.bias else None
            Y = T.arg("Y", T.buffer((m, spec.n), "float32"))

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

            panels = m // PM
            if symbolic or panels:
                with T.parallel(0, panels) as po:
                    panel(po * PM, PM)
            if symbolic:                        # the last rows one at a time
                with T.serial(0, m % PM) as r:
                    panel(panels * PM + r, 1)
            elif spec.m % PM:
                panel(panels * PM, spec.m % PM)
    return ib.get()
