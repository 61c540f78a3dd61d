"""The graph rewritten to the plan's channel shrinking (``passes/transform/shrink.py``): what runs is what it says.

Each narrow tensor (``Plan.channels``) holds only its kept channels; each shrunk GEMM (``OpPlan.shrink``) runs as
the same torch op on its weight sliced at compile time (``<weight>_shrunk``), its bias holding what the dropped input
channels contribute (computed once from the dead channels' constant maps: bias, BatchNorm shift, activation of them),
plus a constant bias map where padding makes that vary over positions. Where a tensor's layout differs from what its
reader needs, one conversion op runs between them: ``index_select`` (a gather), or ``constant_pad_nd`` of one zero
channel + ``index_select`` + the dropped channels' constants (a scatter). The rewritten graph holds only ATen ops, so it
runs, verifies, saves and loads (without TVM) like any other.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..graph import Graph, Op, TensorRef, Value, bind_call
from ..tesa import TeSA, bits_of_dtype
from .transform.channels import Analysis, analyse, axis_of, unpack
from .transform.plan import OpPlan, Plan
from .transform.shrink import FUSING_TARGETS, cat_parts

A = torch.ops.aten


def _slice_tesa(tesa: TeSA, axis: int, idx: torch.Tensor) -> TeSA:
    shape = list(tesa.shape)
    shape[axis] = len(idx)
    if tesa.uniform is not None:
        return TeSA.dense(shape, tesa.uniform)
    return TeSA(tesa.view().index_select(axis, idx).contiguous(), _trusted=True)


class Maps:
    """The dead channels' values of analysed tensors (batch 1; live channels zero), computed once where read."""

    def __init__(self, an: Analysis):
        self.an, self.graph, self.memo = an, an.graph, {}

    def shape(self, t: str, axis: int) -> list[int]:
        full = self.graph.tensor(t).shape
        if axis == 1 and len(full) >= 3:
            return [1, *full[1:]]
        return [full[d] if d == axis else 1 for d in range(len(full))]

    def of(self, t: str) -> torch.Tensor | None:
        """The map of ``t`` (None: every channel live or zero, nothing to add)."""
        if t in self.memo:
            return self.memo[t]
        s = self.an.states.get(t)
        value = None
        if s is not None and not bool(s.live.all()):
            value = self._compute(t, s)
        self.memo[t] = value
        return value

    def _input(self, t: str, axis: int, keep=None) -> torch.Tensor:
        m = self.of(t) if t in self.an.states and self.an.states[t].axis == axis else None
        m = torch.zeros(self.shape(t, axis)) if m is None else m.clone()
        if keep is not None:
            idx = keep.nonzero().reshape(-1)
            m.index_fill_(axis, idx, 0.0)
        return m

    def _weights(self, op: Op) -> dict:
        env = {}
        for t in op.inputs:
            v = self.graph.tensor(t)
            if v.kind == "weight" and v.has_data:
                env[t] = v.tesa.apply(v.data).to(torch.float32) if v.data.is_floating_point() else v.data
        return env

    def gemm_base(self, op: Op, keep_in) -> torch.Tensor:
        """A GEMM's output on its input's dead channels outside ``keep_in`` (zeros elsewhere): its bias, with what the
        dropped channels contribute."""
        axis = axis_of(self.graph, op)
        x = op.input_of("input")
        env = {**self._weights(op), x: self._input(x, axis, keep_in)}
        with torch.no_grad():
            return op.call(env)[0].to(torch.float32)

    def _compute(self, t: str, s) -> torch.Tensor:
        op = self.graph.op(self.graph.producer(t))
        if op.name in self.an.gemms:
            out = self.gemm_base(op, self.an.state(op.input_of("input"), s.axis).live)
        else:
            env = self._weights(op)
            for x in op.inputs:
                if x not in env:
                    env[x] = self._input(x, s.axis, self.an.state(x, s.axis).live if x in self.an.states else None)
            with torch.no_grad():
                out = op.call(env)[0].to(torch.float32)
        out = out.index_fill(s.axis, s.live.nonzero().reshape(-1), 0.0)
        return out.expand(self.shape(t, s.axis)).contiguous() if out.dim() == len(self.shape(t, s.axis)) else out


class Rewriter:
    def __init__(self, graph: Graph, plan: Plan, prof):
        self.graph, self.plan, self.prof = graph, plan, prof
        self.an = analyse(graph)
        self.maps = Maps(self.an)
        self.layouts = {t: unpack(k, self.an.states[t].size) for t, k in plan.channels.items() if t in self.an.states}
        self.out = Graph(graph.name)
        self.ops: list[Op] = []
        self.new_plans: dict[str, OpPlan] = {}
        self.cache: dict = {}
        self.names: set[str] = set()
        self.replaced: set[str] = set()        # weights a shrunk GEMM no longer reads

    # ---- tensors and ops -----------------------------------------------------------------------------------------
    def unique(self, name: str) -> str:
        out, i = name, 1
        while self.graph.has_tensor(out) or out in self.names or self.out.has_tensor(out):
            out, i = f"{name}_{i}", i + 1
        self.names.add(out)
        return out

    def constant(self, name: str, data: torch.Tensor, why: str = "") -> str:
        name = self.unique(name)
        self.out.add_tensor(Value(name, tuple(data.shape), data.dtype, "weight",
                                  TeSA.dense(data.shape, bits_of_dtype(data.dtype)), data))
        if why:
            self.plan.derived[name] = why
        return name

    def activation(self, like: str, name: str, axis: int, keep) -> str:
        """A new tensor like ``like`` with ``keep``'s channels along ``axis`` (None: all)."""
        v = self.graph.tensor(like)
        name = self.unique(name)
        shape, tesa = list(v.shape), v.tesa
        if keep is not None:
            idx = keep.nonzero().reshape(-1)
            shape[axis] = len(idx)
            tesa = _slice_tesa(tesa, axis, idx)
        self.out.add_tensor(Value(name, tuple(shape), v.dtype, "activation", tesa))
        return name

    def emit(self, name: str, op_type: str, target, args: tuple, outputs: list[str], us: float, note: str) -> None:
        inputs, roles, attrs = bind_call(target, args, {})
        self.ops.append(Op(name, op_type, inputs, outputs, attrs, roles, target, args, {}))
        self.new_plans[name] = OpPlan(name, op_type, "torch", us, us, note=note)

    def us(self, *tensors: str) -> float:
        """A boundary op's estimate: one call (none where Inductor fuses it, as the plan priced it) and a pass over
        ``tensors``."""
        values = [self.out.tensor(t) for t in tensors]
        fixed = 0.0 if self.prof.target in FUSING_TARGETS else self.prof.fixed_us
        return fixed + self.prof.memory_us(sum(math.prod(v.shape) * v.dtype.itemsize for v in values))

    # ---- conversions ---------------------------------------------------------------------------------------------
    def convert(self, src_name: str, t: str, axis: int, src, dst, reader: str, into: str | None = None) -> str:
        """``src_name`` (tensor ``t``'s channels ``src`` along ``axis``; None: all) as channels ``dst``."""
        n = self.graph.tensor(t).shape[axis]
        src_ch = torch.arange(n) if src is None else src.nonzero().reshape(-1)
        dst_ch = torch.arange(n) if dst is None else dst.nonzero().reshape(-1)
        if torch.equal(src_ch, dst_ch):
            return src_name
        key = (src_name, tuple(dst_ch.tolist()))
        if key in self.cache and into is None:
            return self.cache[key]
        where = torch.full((n,), -1, dtype=torch.long)
        where[src_ch] = torch.arange(len(src_ch))
        pos = where[dst_ch]
        missing = pos < 0
        out = into or self.activation(t, f"{t}_to{len(dst_ch)}", axis, dst)
        what = f"{len(src_ch)}→{len(dst_ch)} channels of {t} for {reader}"
        if not bool(missing.any()):
            idx = self.constant(f"_shrink.{out}_index", pos)
            self.emit(f"gather_{out}", "index_select", A.index_select.default, (TensorRef(src_name), axis,
                      TensorRef(idx)), [out], self.us(src_name, out), f"gather {what}")
        else:
            ndim = len(self.graph.tensor(t).shape)
            v = self.graph.tensor(t)
            padded = self.unique(f"{t}_pad")
            shape = tuple(len(src_ch) + 1 if d == axis else s for d, s in enumerate(v.shape))
            self.out.add_tensor(Value(padded, shape, v.dtype, "activation", TeSA.dense(shape, bits_of_dtype(v.dtype))))
            self.emit(f"pad_{out}", "constant_pad_nd", A.constant_pad_nd.default,
                      (TensorRef(src_name), [0, 0] * (ndim - 1 - axis) + [0, 1], 0.0), [padded],
                      self.us(src_name, padded), f"scatter {what}: one zero channel")
            idx = self.constant(f"_shrink.{out}_index", torch.where(missing, len(src_ch), pos))
            base = self.maps.of(t)
            base = None if base is None else base.index_select(axis, dst_ch).index_fill(
                axis, (~missing).nonzero().reshape(-1), 0.0)
            sel = out if base is None or not bool(base.any()) else self.activation(t, f"{out}_sel", axis, dst)
            self.emit(f"scatter_{out}", "index_select", A.index_select.default,
                      (TensorRef(padded), axis, TensorRef(idx)), [sel], self.us(padded, sel), f"scatter {what}")
            if sel != out:
                const = self.constant(f"_shrink.{out}_constants", base.to(self.graph.tensor(t).dtype),
                                      f"the dropped channels' constants of {t}")
                self.emit(f"fill_{out}", "add", A.add.Tensor, (TensorRef(sel), TensorRef(const)), [out],
                          self.us(sel, out), f"the constants of the dropped channels of {t}")
        if into is None:
            self.cache[key] = out
        return out

    # ---- ops -----------------------------------------------------------------------------------------------------
    def shrunk_gemm(self, op: Op, p: OpPlan, rename: dict) -> None:
        site, g = self.an.gemms[op.name], self.graph
        axis = axis_of(g, op)
        cout, cin = g.tensor(site.y).shape[axis], g.tensor(site.x).shape[axis]
        out_keep = unpack(p.shrink["out_keep"], cout) if p.shrink.get("out_keep") else None
        in_keep = unpack(p.shrink["in_keep"], cin) if p.shrink.get("in_keep") else None
        x_axis = self.an.states[site.x].axis if site.x in self.an.states else axis
        x = self.convert(rename.get(site.x, site.x), site.x, x_axis, self.layouts.get(site.x), in_keep, op.name)
        wv = g.tensor(site.w)
        self.replaced.add(site.w)
        w = wv.tesa.apply(wv.data)
        wtesa = wv.tesa
        rows = out_keep.nonzero().reshape(-1) if out_keep is not None else None
        if rows is not None:
            w, wtesa = w.index_select(0, rows), _slice_tesa(wtesa, 0, rows)
        if in_keep is not None and site.groups == 1:
            cols = in_keep.nonzero().reshape(-1)
            w, wtesa = w.index_select(1, cols), _slice_tesa(wtesa, 1, cols)
        wname = self.unique(f"{site.w}_shrunk")
        self.out.add_tensor(Value(wname, tuple(w.shape), wv.dtype, "weight", wtesa, w.contiguous()))
        self.plan.derived[wname] = f"{describe_keep(out_keep, cout)} rows, {describe_keep(in_keep, cin)} input " \
                                   f"channels of {site.w}"
        base = self.maps.gemm_base(op, in_keep if in_keep is not None else torch.ones(cin, dtype=torch.bool))
        if rows is not None:
            base = base.index_select(axis, rows)
        c = base.shape[axis]
        flat = base.movedim(axis, 0).reshape(c, -1)
        uniform = bool(((flat - flat[:, :1]).abs() <= 1e-6 * (1 + flat.abs().amax())).all())
        bdtype = g.tensor(site.b).dtype if site.b else wv.dtype
        bias = None
        if uniform and (site.b or bool(flat.any())):
            bias = self.constant(f"{site.w.rsplit('.', 1)[0]}.bias_shrunk" if "." in site.w else f"{site.w}_bias",
                                 flat[:, 0].to(bdtype).contiguous(), f"bias of {op.name} with its dropped inputs")
        y_keep = self.layouts.get(site.y)
        same = (out_keep is None and y_keep is None) or (out_keep is not None and y_keep is not None
                                                         and torch.equal(out_keep, y_keep))
        y = site.y if same else self.activation(site.y, f"{site.y}_out", axis, out_keep)
        y0 = y if uniform else self.activation(site.y, f"{site.y}_nobias", axis, out_keep)
        if op.op == "linear":
            args = (TensorRef(x), TensorRef(wname), TensorRef(bias) if bias else None)
        else:
            groups = int(p.shrink.get("groups", 1))
            args = (TensorRef(x), TensorRef(wname), TensorRef(bias) if bias else None, op.attrs.get("stride", 1),
                    op.attrs.get("padding", 0), op.attrs.get("dilation", 1), groups)
        op_type, target = op.op, op.target
        if op.op == "conv2d" and self.prof.target == "cpu" and _native_at_batch_one(g.tensor(site.x), w, args):
            op_type, target = "mkldnn_convolution", A.mkldnn_convolution.default
            args = (*args[:3], _pair(args[4]), _pair(args[3]), _pair(args[5]), args[6])
        inputs, roles, attrs = bind_call(target, args, {})
        self.ops.append(Op(op.name, op_type, inputs, [y0], attrs, roles, target, args, {}, op.source))
        n, k = int(w.shape[0]), math.prod(w.shape[1:])
        self.new_plans[op.name] = p.replace(weight=wname, gemm=(p.gemm[0], n, k) if p.gemm else None,
                                            density=wtesa.density, bits=wtesa.bit_histogram())
        if not uniform:
            bmap = self.constant(f"_shrink.{op.name}_bias_map", base.to(bdtype).contiguous(),
                                 f"bias map of {op.name}: its dropped inputs vary over positions (padding)")
            self.emit(f"{op.name}_bias_map", "add", A.add.Tensor, (TensorRef(y0), TensorRef(bmap)), [y],
                      self.us(y0, y), "what the dropped input channels add, varying over positions (padding)")
        if not same:
            self.convert(y, site.y, axis, out_keep, y_keep, "its readers", into=site.y)

    def run(self) -> Graph:
        g, an = self.graph, self.an
        for v in g.tensors():
            keep = self.layouts.get(v.name)
            if keep is None:
                self.out.add_tensor(v.copy())
            else:
                s = an.states[v.name]
                idx = keep.nonzero().reshape(-1)
                shape = list(v.shape)
                shape[s.axis] = len(idx)
                self.out.add_tensor(Value(v.name, tuple(shape), v.dtype, v.kind, _slice_tesa(v.tesa, s.axis, idx)))
        for op in g.ops():
            p = self.plan.ops.get(op.name)
            if p is not None and p.kind == "shrink":
                self.shrunk_gemm(op, p, {})
                continue
            y = op.outputs[0] if op.outputs else None
            narrow_link = op.name in an.links and self.layouts.get(y) is not None
            rename = {}
            if narrow_link and op.op in ("cat", "concat"):
                for t, k in cat_parts(an, op, self.layouts[y]):
                    if t not in an.links[op.name]:
                        rename[t] = self.convert(t, t, an.states[y].axis, self.layouts.get(t), k, op.name)
            elif not narrow_link:
                for t in op.inputs:
                    if self.layouts.get(t) is not None:
                        rename[t] = self.convert(t, t, an.states[t].axis, self.layouts[t], None, op.name)
            outputs = list(op.outputs)
            whole = y is not None and not narrow_link and self.layouts.get(y) is not None
            if whole:
                outputs[0] = self.activation(y, f"{y}_whole", an.states[y].axis, None)
            args, kwargs = _rename(op.args, rename), _rename(op.kwargs, rename)
            inputs, roles, attrs = bind_call(op.target, args, kwargs) if rename else (op.inputs, op.roles, op.attrs)
            self.ops.append(Op(op.name, op.op, list(inputs), outputs, dict(attrs), list(roles), op.target, args,
                               dict(kwargs), op.source, op.multi_output, dict(op.meta)))
            if whole:
                self.convert(outputs[0], y, an.states[y].axis, None, self.layouts[y], "its region", into=y)
        return self.finish()

    def finish(self) -> Graph:
        g, out = self.graph, self.out
        read = {t for op in self.ops for t in [*op.inputs, *op.outputs]} | set(g.inputs) | set(g.outputs)
        final = Graph(g.name)
        for v in out.tensors():
            if v.name in read:
                final.add_tensor(v)
            elif v.kind == "weight" and v.has_data and v.name in self.replaced:
                final.add_tensor(dataclasses.replace(v, data=None))   # its name still gives its TeSA
        for op in self.ops:
            final.add_op(op)
        final.inputs, final.outputs = list(g.inputs), list(g.outputs)
        g.copy_facts(final)
        ops = {}
        for op in self.ops:
            ops[op.name] = self.new_plans.get(op.name) or self.plan.ops[op.name]
        self.plan.ops = ops
        return final


def _pair(v) -> list[int]:
    return [int(v)] * 2 if isinstance(v, int) else [int(x) for x in v]


def _native_at_batch_one(x: Value, w: torch.Tensor, args: tuple) -> bool:
    """Whether torch would run this shrunk fp32 convolution at batch 1 as its native (non-oneDNN) kernel: a 3×3 or
    smaller filter over an input of at most 20480 elements a sample (``ConvParams::use_mkldnn``), which shrinking
    the input makes common. oneDNN's kernel computes the same and runs such a layer's small activations and large
    weights far faster; ``mkldnn_convolution`` asks for it (at any batch, where torch would pick it from batch 2)."""
    if not torch.backends.mkldnn.is_available() or w.dtype != torch.float32 or len(w.shape) != 4:
        return False
    if isinstance(args[4], str) or int(args[6]) != 1 or not all(isinstance(d, int) for d in x.shape[1:]):
        return False
    return not (w.shape[-1] > 3 and w.shape[-2] > 3) and math.prod(x.shape[1:]) * (w.shape[1] / x.shape[1]) <= 20480


def describe_keep(keep, n: int) -> str:
    return f"{n if keep is None else int(keep.sum())} of {n}"


def _rename(template, rename: dict):
    from torch.utils import _pytree as pytree
    return pytree.tree_map_only(TensorRef, lambda r: TensorRef(rename.get(r.name, r.name)), template)


def shrink_graph(graph: Graph, plan: Plan, prof, folded: dict | None = None) -> Graph:
    """``graph`` rewritten to ``plan``'s channel shrinking (``graph`` itself where the plan shrinks nothing); the
    constants derived from weights (``folded`` by ``fold_bn`` too) are recorded in ``plan.derived``."""
    plan.derived.update(folded or {})
    if not plan.channels and not any(p.kind == "shrink" for p in plan.ops.values()):
        return graph
    return Rewriter(graph, plan, prof).run()


__all__ = ["shrink_graph"]
