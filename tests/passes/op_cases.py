"""Random single-op cases for rule soundness tests: one strategy per op family.

A case is ``(target, args, kwargs, data)``: the ATen op, its argument template with
``TensorRef`` placeholders, and random tensors (never zeros) for the placeholders.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from sparta.graph import Op, TensorRef, bind_call

A = torch.ops.aten
R = TensorRef


def dims(n, lo=1, hi=5):
    return st.lists(st.integers(lo, hi), min_size=n, max_size=n).map(tuple)


def rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 4, shape, generator=g).to(dtype)
    x = torch.randn(shape, generator=g)
    return torch.where(x == 0, torch.ones_like(x), x).to(dtype)


def make_op(name, target, args, kwargs, data):
    """A standalone Op (and its dense outputs on ``data``) for calling a rule directly."""
    inputs, roles, attrs = bind_call(target, args, kwargs)
    result = target(*_sub(args, data), **_sub(kwargs, data))
    multi = isinstance(result, (list, tuple))
    outs = list(result) if multi else [result]
    op = Op(name, name, inputs, [f"out{i}" for i in range(len(outs))], attrs, roles, target, tuple(args),
            dict(kwargs), multi_output=multi)
    op.meta = {"in_dtypes": [data[n].dtype for n in inputs], "out_dtypes": [o.dtype for o in outs]}
    return op, outs


def _sub(t, env):
    from sparta.graph import substitute
    return substitute(t, env)


UNARY_TARGETS = {
    "relu": (A.relu.default, ()), "gelu": (A.gelu.default, ()), "silu": (A.silu.default, ()),
    "tanh": (A.tanh.default, ()), "sigmoid": (A.sigmoid.default, ()), "neg": (A.neg.default, ()),
    "abs": (A.abs.default, ()), "sqrt": (A.sqrt.default, ()), "rsqrt": (A.rsqrt.default, ()),
    "exp": (A.exp.default, ()), "expm1": (A.expm1.default, ()), "log": (A.log.default, ()),
    "log1p": (A.log1p.default, ()), "erf": (A.erf.default, ()), "hardtanh": (A.hardtanh.default, (-0.5, 0.5)),
    "hardswish": (A.hardswish.default, ()), "hardsigmoid": (A.hardsigmoid.default, ()),
    "mish": (A.mish.default, ()), "leaky_relu": (A.leaky_relu.default, (0.1,)), "elu": (A.elu.default, ()),
    "softplus": (A.softplus.default, ()), "sin": (A.sin.default, ()), "cos": (A.cos.default, ()),
    "square": (A.square.default, ()), "sign": (A.sign.default, ()), "reciprocal": (A.reciprocal.default, ()),
    "ceil": (A.ceil.default, ()), "floor": (A.floor.default, ()), "round": (A.round.default, ()),
    "trunc": (A.trunc.default, ()), "clamp": (A.clamp.default, (-1.0, 1.0)), "clamp_min": (A.clamp_min.default, (0.2,)),
    "clamp_max": (A.clamp_max.default, (0.5,)), "clone": (A.clone.default, ()), "dropout": (A.dropout.default, (0.5, False)),
    "alias": (A.alias.default, ()), "detach": (A.detach.default, ()), "lift_fresh_copy": (A.lift_fresh_copy.default, ()),
    "_to_copy": (A._to_copy.default, ()), "contiguous": (A.contiguous.default, ()),
    "pow": (A.pow.Tensor_Scalar, (2,)), "relu6": (A.relu6.default, ()), "celu": (A.celu.default, ()),
    "selu": (A.selu.default, ()), "nan_to_num": (A.nan_to_num.default, ()),
    "native_dropout": (A.native_dropout.default, (0.5, False)), "logical_not": (A.logical_not.default, ()),
}

BINARY_TARGETS = {
    "add": A.add.Tensor, "sub": A.sub.Tensor, "rsub": A.rsub.Tensor, "maximum": A.maximum.default,
    "minimum": A.minimum.default, "fmax": A.fmax.default, "fmin": A.fmin.default, "eq": A.eq.Tensor,
    "ne": A.ne.Tensor, "gt": A.gt.Tensor, "ge": A.ge.Tensor, "lt": A.lt.Tensor, "le": A.le.Tensor,
    "logical_or": A.logical_or.default, "logical_xor": A.logical_xor.default, "mul": A.mul.Tensor,
    "logical_and": A.logical_and.default, "div": A.div.Tensor, "remainder": A.remainder.Tensor,
    "fmod": A.fmod.Tensor, "floor_divide": A.floor_divide.default, "copy": A.copy.default,
}
INT_BINARY = {"bitwise_or": A.bitwise_or.Tensor, "bitwise_xor": A.bitwise_xor.Tensor,
              "bitwise_and": A.bitwise_and.Tensor, "bitwise_not": A.bitwise_not.default}
SCALAR_BINARY = {"add": A.add.Scalar, "mul": A.mul.Scalar, "div": A.div.Scalar, "sub": A.sub.Scalar,
                 "rsub": A.rsub.Scalar, "gt": A.gt.Scalar, "eq": A.eq.Scalar}


@st.composite
def unary_case(draw, name):
    target, extra = UNARY_TARGETS[name]
    shape = draw(dims(draw(st.integers(1, 3))))
    return target, (R("x"), *extra), {}, {"x": rand(shape, seed=draw(st.integers(0, 99)))}


@st.composite
def binary_case(draw, name):
    """Broadcasting pairs: y's shape is x's with some dims set to 1 or dropped."""
    shape = draw(dims(draw(st.integers(1, 3))))
    yshape = tuple(1 if draw(st.booleans()) else s for s in shape)[draw(st.integers(0, len(shape) - 1)):]
    if draw(st.booleans()):
        shape, yshape = yshape or (1,), shape
    seed = draw(st.integers(0, 99))
    if name in INT_BINARY:
        if name == "bitwise_not":
            return INT_BINARY[name], (R("x"),), {}, {"x": rand(shape, torch.int32, seed)}
        return INT_BINARY[name], (R("x"), R("y")), {}, {"x": rand(shape, torch.int32, seed),
                                                        "y": rand(yshape, torch.int32, seed + 1)}
    if draw(st.booleans()) and name in SCALAR_BINARY:
        c = draw(st.sampled_from([0, 0.0, 2.0, -1.5]))
        if name == "div" and c == 0:
            c = 3.0
        return SCALAR_BINARY[name], (R("x"), c), {}, {"x": rand(shape, seed=seed)}
    dt = torch.bool if name.startswith("logical") else torch.float32
    return BINARY_TARGETS[name], (R("x"), R("y")), {}, {"x": rand(shape, dt, seed), "y": rand(yshape, dt, seed + 1)}


@st.composite
def ternary_case(draw, name):
    shape = draw(dims(2))
    seed = draw(st.integers(0, 99))
    if name == "where":
        return A.where.self, (R("c"), R("x"), R("y")), {}, {"c": rand(shape, torch.bool, seed),
                                                            "x": rand(shape, seed=seed + 1), "y": rand(shape, seed=seed + 2)}
    if name == "masked_fill":
        value = draw(st.sampled_from([0.0, 1.5]))
        return A.masked_fill.Scalar, (R("x"), R("m"), value), {}, {"x": rand(shape, seed=seed),
                                                                   "m": rand(shape, torch.bool, seed + 1)}
    target = {"lerp": A.lerp.Tensor, "addcmul": A.addcmul.default, "addcdiv": A.addcdiv.default}[name]
    return target, (R("x"), R("y"), R("z")), {}, {n: rand(shape, seed=seed + i) for i, n in enumerate("xyz")}


@st.composite
def matmul_case(draw, name):
    m, k, n = draw(dims(3, 1, 6))
    seed = draw(st.integers(0, 99))
    b = draw(st.integers(1, 3))
    if name == "linear":
        lead = draw(st.sampled_from([(), (b,)]))
        bias = draw(st.booleans())
        data = {"x": rand((*lead, m, k), seed=seed), "w": rand((n, k), seed=seed + 1)}
        if bias:
            data["b"] = rand((n,), seed=seed + 2)
        return A.linear.default, (R("x"), R("w"), R("b") if bias else None), {}, data
    if name == "mm":
        return A.mm.default, (R("a"), R("b")), {}, {"a": rand((m, k), seed=seed), "b": rand((k, n), seed=seed + 1)}
    if name == "bmm":
        return A.bmm.default, (R("a"), R("b")), {}, {"a": rand((b, m, k), seed=seed), "b": rand((b, k, n), seed=seed + 1)}
    if name == "matmul":
        ashape = draw(st.sampled_from([(m, k), (b, m, k), (2, b, m, k), (k,)]))
        bshape = draw(st.sampled_from([(k, n), (b, k, n), (k,)]))
        if len(ashape) == 1 and len(bshape) == 1:
            bshape = (k, n)
        return A.matmul.default, (R("a"), R("b")), {}, {"a": rand(ashape, seed=seed), "b": rand(bshape, seed=seed + 1)}
    if name == "addmm":
        beta, alpha = draw(st.sampled_from([(1, 1), (0, 1), (1, 0), (0.5, 2.0)]))
        cshape = draw(st.sampled_from([(m, n), (n,), (1, n)]))
        return A.addmm.default, (R("c"), R("a"), R("b")), {"beta": beta, "alpha": alpha}, \
            {"c": rand(cshape, seed=seed), "a": rand((m, k), seed=seed + 1), "b": rand((k, n), seed=seed + 2)}
    if name == "baddbmm":
        return A.baddbmm.default, (R("c"), R("a"), R("b")), {}, \
            {"c": rand((b, m, n), seed=seed), "a": rand((b, m, k), seed=seed + 1), "b": rand((b, k, n), seed=seed + 2)}
    if name in ("mv", "addmv", "dot", "vdot"):
        if name == "mv":
            return A.mv.default, (R("a"), R("v")), {}, {"a": rand((m, k), seed=seed), "v": rand((k,), seed=seed + 1)}
        if name == "addmv":
            return A.addmv.default, (R("c"), R("a"), R("v")), {}, {"c": rand((m,), seed=seed), "a": rand((m, k), seed=seed),
                                                                    "v": rand((k,), seed=seed + 1)}
        return getattr(A, name).default, (R("a"), R("v")), {}, {"a": rand((k,), seed=seed), "v": rand((k,), seed=seed + 1)}
    raise KeyError(name)


@st.composite
def conv_case(draw, name):
    seed = draw(st.integers(0, 99))
    groups = draw(st.sampled_from([1, 2, 4]))
    cin = groups * draw(st.integers(1, 2))
    cout = groups * draw(st.integers(1, 2))
    stride, pad, dil = draw(st.integers(1, 2)), draw(st.integers(0, 2)), draw(st.integers(1, 2))
    ksz = draw(st.integers(1, 3))
    bias = draw(st.booleans())
    if name in ("conv1d", "conv2d", "conv3d", "convolution"):
        nd = {"conv1d": 1, "conv2d": 2, "conv3d": 1, "convolution": 2}[name]
        nd = 3 if name == "conv3d" else nd
        size = draw(st.integers(ksz * dil, 7))
        data = {"x": rand((2, cin, *([size] * nd)), seed=seed), "w": rand((cout, cin // groups, *([ksz] * nd)), seed=seed + 1)}
        if bias:
            data["b"] = rand((cout,), seed=seed + 2)
        b = R("b") if bias else None
        if name == "convolution":
            return A.convolution.default, (R("x"), R("w"), b, [stride] * nd, [pad] * nd, [dil] * nd, False, [0] * nd, groups), {}, data
        target = {"conv1d": A.conv1d.default, "conv2d": A.conv2d.default, "conv3d": A.conv3d.default}[name]
        return target, (R("x"), R("w"), b, [stride] * nd, [pad] * nd, [dil] * nd, groups), {}, data
    # transposed convolutions
    nd = int(name[-2])
    size = draw(st.integers(1, 5))
    data = {"x": rand((2, cin, *([size] * nd)), seed=seed), "w": rand((cin, cout // groups, *([ksz] * nd)), seed=seed + 1)}
    packet = getattr(A, name)
    target = getattr(packet, packet.overloads()[0])
    return target, (R("x"), R("w"), None, [stride] * nd, [0] * nd, [0] * nd, groups, [dil] * nd), {}, data


@st.composite
def movement_case(draw, name):
    seed = draw(st.integers(0, 99))
    shape = draw(dims(3, 1, 4))
    x = rand(shape, seed=seed)
    cases = {
        "view": (A.view.default, (R("x"), [-1])), "_unsafe_view": (A._unsafe_view.default, (R("x"), [shape[0], -1])),
        "reshape": (A.reshape.default, (R("x"), [shape[0] * shape[1], shape[2]])),
        "permute": (A.permute.default, (R("x"), [2, 0, 1])), "transpose": (A.transpose.int, (R("x"), 0, 2)),
        "expand": (A.expand.default, (R("x"), [2, *shape])), "slice": (A.slice.Tensor, (R("x"), 1, 0, max(shape[1] - 1, 1), 2)),
        "select": (A.select.int, (R("x"), 2, shape[2] - 1)), "unsqueeze": (A.unsqueeze.default, (R("x"), 1)),
        "squeeze": (A.squeeze.dim, (R("x"), 0)), "flatten": (A.flatten.using_ints, (R("x"), 1, 2)),
        "unflatten": (A.unflatten.int, (R("x"), 0, [shape[0], 1])), "narrow": (A.narrow.default, (R("x"), 2, 0, 1)),
        "repeat": (A.repeat.default, (R("x"), [1, 2, 1])), "flip": (A.flip.default, (R("x"), [0, 2])),
        "roll": (A.roll.default, (R("x"), [1], [1])), "movedim": (A.movedim.int, (R("x"), 0, 2)),
        "diagonal": (A.diagonal.default, (R("x"), 0, 0, 1)), "tril": (A.tril.default, (R("x"),)),
        "triu": (A.triu.default, (R("x"), 1)), "split": (A.split.Tensor, (R("x"), 2, 0)),
        "split_with_sizes": (A.split_with_sizes.default, (R("x"), [1, shape[2] - 1] if shape[2] > 1 else [1], 2)),
        "chunk": (A.chunk.default, (R("x"), 2, 1)), "unbind": (A.unbind.int, (R("x"), 0)),
        "constant_pad_nd": (A.constant_pad_nd.default, (R("x"), [1, 0, 0, 2])),
        "tile": (A.tile.default, (R("x"), [2, 1])), "swapaxes": (A.swapaxes.default, (R("x"), 0, 1)),
        "as_strided": (A.as_strided.default, (R("x"), [min(2, x.numel()), 1], [1, 1])),
        "t": (A.t.default, (R("m"),)),
    }
    if name == "t":
        return A.t.default, (R("m"),), {}, {"m": rand(shape[:2], seed=seed)}
    if name in ("cat", "concat", "stack", "hstack", "vstack"):
        y = rand(shape, seed=seed + 1)
        target = {"cat": A.cat.default, "concat": A.concat.default, "stack": A.stack.default,
                  "hstack": A.hstack.default, "vstack": A.vstack.default}[name]
        args = ([R("x"), R("y"), R("x")], 1) if name in ("cat", "concat", "stack") else ([R("x"), R("y")],)
        return target, args, {}, {"x": x, "y": y}
    if name in ("expand_as", "view_as", "reshape_as"):
        other = rand((2, *shape) if name == "expand_as" else (int(x.numel()),), seed=seed + 1)
        return getattr(A, name).default, (R("x"), R("o")), {}, {"x": x, "o": other}
    if name in ("slice_scatter", "select_scatter"):
        if name == "slice_scatter":
            src = rand((shape[0], 1, shape[2]), seed=seed + 1)
            return A.slice_scatter.default, (R("x"), R("s"), 1, 0, 1), {}, {"x": x, "s": src}
        src = rand((shape[0], shape[1]), seed=seed + 1)
        return A.select_scatter.default, (R("x"), R("s"), 2, 0), {}, {"x": x, "s": src}
    if name in ("pixel_shuffle", "pixel_unshuffle", "channel_shuffle"):
        if name == "pixel_shuffle":
            return A.pixel_shuffle.default, (R("x"), 2), {}, {"x": rand((1, 4, 2, 3), seed=seed)}
        if name == "pixel_unshuffle":
            return A.pixel_unshuffle.default, (R("x"), 2), {}, {"x": rand((1, 1, 4, 2), seed=seed)}
        return A.channel_shuffle.default, (R("x"), 2), {}, {"x": rand((1, 4, 2, 2), seed=seed)}
    target, args = cases[name]
    return target, args, {}, {"x": x}


@st.composite
def reduce_case(draw, name):
    seed = draw(st.integers(0, 99))
    shape = draw(dims(3, 1, 4))
    x = rand(shape, seed=seed)
    keep = draw(st.booleans())
    dim = draw(st.sampled_from([[0], [2], [0, 2], [-1]]))
    if name in ("sum", "mean", "nansum", "nanmean"):
        target = {"sum": A.sum.dim_IntList, "mean": A.mean.dim, "nansum": A.nansum.default, "nanmean": A.nanmean.default}[name]
        return target, (R("x"), dim, keep), {}, {"x": x}
    if name in ("amax", "amin"):
        return getattr(A, name).default, (R("x"), dim, keep), {}, {"x": x}
    if name in ("max", "min"):
        return getattr(A, name).dim, (R("x"), dim[0], keep), {}, {"x": x}
    if name in ("var", "std", "var_mean", "std_mean"):
        return getattr(A, name).correction, (R("x"), dim), {"correction": 0, "keepdim": keep}, {"x": x}
    if name in ("norm", "linalg_vector_norm"):
        return A.linalg_vector_norm.default, (R("x"), 2, dim, keep), {}, {"x": x}
    if name in ("prod",):
        return A.prod.dim_int, (R("x"), dim[0], keep), {}, {"x": x}
    if name in ("any", "all"):
        return getattr(A, name).dim, (R("x"), dim[0], keep), {}, {"x": rand(shape, torch.bool, seed)}
    raise KeyError(name)


@st.composite
def norm_case(draw, name):
    seed = draw(st.integers(0, 99))
    n, c, l = draw(dims(3, 1, 5))
    if name in ("softmax", "log_softmax"):
        return getattr(A, name).int, (R("x"), draw(st.sampled_from([0, 1, -1]))), {}, {"x": rand((n, c, l), seed=seed)}
    if name == "layer_norm":
        w, b = draw(st.booleans()), draw(st.booleans())
        nshape = draw(st.sampled_from([[l], [c, l]]))
        data = {"x": rand((n, c, l), seed=seed)}
        if w:
            data["w"] = rand(tuple(nshape), seed=seed + 1)
        if b:
            data["b"] = rand(tuple(nshape), seed=seed + 2)
        return A.layer_norm.default, (R("x"), nshape, R("w") if w else None, R("b") if b else None, 1e-5), {}, data
    if name == "rms_norm":
        w = draw(st.booleans())
        data = {"x": rand((n, c, l), seed=seed)}
        if w:
            data["w"] = rand((l,), seed=seed + 1)
        return A.rms_norm.default, (R("x"), [l], R("w") if w else None, 1e-6), {}, data
    if name == "batch_norm":
        data = {"x": rand((n, c, l, 2), seed=seed), "w": rand((c,), seed=seed + 1), "b": rand((c,), seed=seed + 2),
                "m": rand((c,), seed=seed + 3), "v": rand((c,), seed=seed + 4).abs() + 0.5}
        if draw(st.booleans()):
            return A._native_batch_norm_legit_no_training.default, (R("x"), R("w"), R("b"), R("m"), R("v"), 0.1, 1e-5), {}, data
        return A.batch_norm.default, (R("x"), R("w"), R("b"), R("m"), R("v"), False, 0.1, 1e-5, False), {}, data
    if name == "group_norm":
        g = draw(st.sampled_from([1, 2]))
        c = 2 * c
        data = {"x": rand((n, c, l), seed=seed), "w": rand((c,), seed=seed + 1), "b": rand((c,), seed=seed + 2)}
        return A.group_norm.default, (R("x"), g, R("w"), R("b"), 1e-5, False), {}, data
    raise KeyError(name)


@st.composite
def pool_case(draw, name):
    seed = draw(st.integers(0, 99))
    nd = 1 if name.endswith("1d") else 2
    size = draw(st.integers(3, 7))
    x = rand((2, 3, *([size] * nd)), seed=seed)
    if name.startswith("adaptive"):
        out = [draw(st.integers(1, 3))] * nd
        target = getattr(A, name).default
        return target, (R("x"), out), {}, {"x": x}
    k, s, p = draw(st.integers(2, 3)), draw(st.integers(1, 2)), draw(st.integers(0, 1))
    ceil = draw(st.booleans())
    if name.startswith("max"):
        dil = draw(st.sampled_from([1, 1, 2])) if size >= 5 else 1
        return getattr(A, name).default, (R("x"), [k] * nd, [s] * nd, [p] * nd, [dil] * nd, ceil), {}, {"x": x}
    return getattr(A, name).default, (R("x"), [k] * nd, [s] * nd, [p] * nd, ceil, draw(st.booleans())), {}, {"x": x}


@st.composite
def sdpa_case(draw, name):
    seed = draw(st.integers(0, 99))
    b, h, L, S, e = draw(dims(5, 1, 4))
    causal = draw(st.booleans())
    if causal:
        S = L
    data = {"q": rand((b, h, L, e), seed=seed), "k": rand((b, h, S, e), seed=seed + 1), "v": rand((b, h, S, e), seed=seed + 2)}
    mask = draw(st.sampled_from([None, "bool", "float"])) if not causal else None
    if mask == "bool":
        data["m"] = rand((L, S), torch.bool, seed + 3) | torch.eye(L, S, dtype=torch.bool)
    elif mask == "float":
        data["m"] = rand((b, 1, L, S), seed=seed + 3)
    return A.scaled_dot_product_attention.default, (R("q"), R("k"), R("v"), R("m") if mask else None, 0.0, causal), {}, data


@st.composite
def embedding_case(draw, name):
    seed = draw(st.integers(0, 99))
    v, d = draw(dims(2, 2, 6))
    idx = torch.randint(0, v, draw(dims(2, 1, 4)), generator=torch.Generator().manual_seed(seed))
    return A.embedding.default, (R("w"), R("i")), {}, {"w": rand((v, d), seed=seed), "i": idx}


@st.composite
def index_case(draw, name):
    """Lookups, selections and scatters; index tensors cover their whole valid range."""
    seed = draw(st.integers(0, 99))
    a, b, c = draw(dims(3, 2, 5))
    g = torch.Generator().manual_seed(seed)
    x = rand((a, b, c), seed=seed)
    dim = draw(st.sampled_from([0, 1, 2, -1]))
    k = draw(st.integers(1, 3))
    idx = torch.randint(0, (a, b, c)[dim], (a, b, c)[:dim % 3] + (k,) + (a, b, c)[dim % 3 + 1:], generator=g)
    vec = torch.randint(0, (a, b, c)[dim], (k,), generator=g)
    if name == "index":
        j = torch.randint(0, c, (k,), generator=g)
        if draw(st.booleans()):
            return A.index.Tensor, (R("x"), [R("i"), None, R("j")]), {}, {"x": x, "i": vec.clamp(max=a - 1), "j": j}
        return A.index.Tensor, (R("x"), [None, None, R("j")]), {}, {"x": x, "j": j}
    if name == "gather":
        return A.gather.default, (R("x"), dim, R("i")), {}, {"x": x, "i": idx}
    if name == "index_select":
        return A.index_select.default, (R("x"), dim, R("i")), {}, {"x": x, "i": vec}
    if name == "take":
        return A.take.default, (R("x"), R("i")), {}, {"x": x, "i": torch.randint(0, x.numel(), (k, 2), generator=g)}
    if name in ("sort", "argsort"):
        return A.sort.default, (R("x"), dim, draw(st.booleans())), {}, {"x": x}
    if name == "msort":
        return A.msort.default, (R("x"),), {}, {"x": x}
    if name == "topk":
        return A.topk.default, (R("x"), min(k, (a, b, c)[dim]), dim), {}, {"x": x}
    if name == "kthvalue":
        return A.kthvalue.default, (R("x"), min(k, (a, b, c)[dim]), dim, draw(st.booleans())), {}, {"x": x}
    if name in ("median", "nanmedian", "mode"):
        if name != "mode" and draw(st.booleans()):
            return getattr(A, name).default, (R("x"),), {}, {"x": x}
        return getattr(A, name).dim if name != "mode" else A.mode.default, (R("x"), dim, draw(st.booleans())), {}, {"x": x}
    if name in ("cummax", "cummin"):
        return getattr(A, name).default, (R("x"), dim), {}, {"x": x}
    if name in ("argmax", "argmin"):
        return getattr(A, name).default, (R("x"), draw(st.sampled_from([None, dim])), draw(st.booleans())), {}, {"x": x}
    src = rand(idx.shape, seed=seed + 1)
    if name == "scatter":
        if draw(st.booleans()):
            return A.scatter.value, (R("x"), dim, R("i"), draw(st.sampled_from([0.0, 1.5]))), {}, {"x": x, "i": idx}
        return A.scatter.src, (R("x"), dim, R("i"), R("s")), {}, {"x": x, "i": idx, "s": src}
    if name == "scatter_add":
        return A.scatter_add.default, (R("x"), dim, R("i"), R("s")), {}, {"x": x, "i": idx, "s": src}
    if name == "scatter_reduce":
        how = draw(st.sampled_from(["sum", "prod", "mean", "amax", "amin"]))
        return A.scatter_reduce.two, (R("x"), dim, R("i"), R("s"), how), {"include_self": draw(st.booleans())}, \
            {"x": x, "i": idx, "s": src}
    rows = rand((k, b, c), seed=seed + 2)
    row_idx = torch.randint(0, a, (k,), generator=g)
    if name == "index_put":
        return A.index_put.default, (R("x"), [R("i")], R("v"), draw(st.booleans())), {}, \
            {"x": x, "i": row_idx, "v": rows}
    if name in ("index_add", "index_copy"):
        return getattr(A, name).default, (R("x"), 0, R("i"), R("v")), {}, {"x": x, "i": row_idx, "v": rows}
    if name == "index_fill":
        return A.index_fill.int_Scalar, (R("x"), 0, R("i"), draw(st.sampled_from([0.0, 2.0]))), {}, \
            {"x": x, "i": row_idx}
    if name == "masked_scatter":
        return A.masked_scatter.default, (R("x"), R("m"), R("v")), {}, \
            {"x": x, "m": rand((a, b, c), torch.bool, seed + 3), "v": rand((a * b * c,), seed=seed + 4)}
    if name in ("searchsorted", "bucketize"):
        edges = torch.sort(rand((c,), seed=seed + 5)).values
        if name == "bucketize":
            return A.bucketize.Tensor, (R("x"), R("e")), {}, {"x": x, "e": edges}
        return A.searchsorted.Tensor, (R("e"), R("x")), {}, {"x": x, "e": edges}
    if name == "histc":
        return A.histc.default, (R("x"), 4, -1.0, 1.0), {}, {"x": x}
    if name in ("_embedding_bag", "_embedding_bag_forward_only"):
        ids = torch.randint(0, a, (b * 2,), generator=g)
        offsets = torch.tensor([0, b])
        return getattr(A, name).default, (R("w"), R("i"), R("o")), {}, \
            {"w": rand((a, c), seed=seed), "i": ids, "o": offsets}
    raise KeyError(name)


def case_for(name):
    from sparta.passes.rules.index import DATA_DEPENDENT, SCATTERS, SELECTIONS
    if name in ("index", "gather", "index_select") + SELECTIONS + SCATTERS + DATA_DEPENDENT:
        return index_case(name)
    from sparta.passes.rules.elementwise import ALL_OF, ANY_OF, DIV_LIKE
    if name in UNARY_TARGETS:
        return unary_case(name)
    if name in ("where", "masked_fill", "lerp", "addcmul", "addcdiv"):
        return ternary_case(name)
    if name in BINARY_TARGETS or name in INT_BINARY or name in ANY_OF + ALL_OF + DIV_LIKE:
        return binary_case(name)
    for fn, names in ((matmul_case, ("linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "mv", "addmv", "dot", "vdot")),
                      (conv_case, ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d",
                                   "conv_transpose3d")),
                      (norm_case, ("softmax", "log_softmax", "layer_norm", "rms_norm", "batch_norm", "group_norm")),
                      (sdpa_case, ("scaled_dot_product_attention",)), (embedding_case, ("embedding",))):
        if name in names:
            return fn(name)
    from sparta.passes.rules.pool import pool as _pool  # noqa: F401
    if "pool" in name:
        return pool_case(name)
    from sparta.passes.rules.reduce import ALL_GROUP, ANY_GROUP
    if name in ANY_GROUP + ALL_GROUP:
        return reduce_case(name)
    return movement_case(name)
