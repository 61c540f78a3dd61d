"""CPU block-sparse linear template: against its torch reference on fresh random data."""

import re

import pytest
import torch

from sparta.codegen.build import build_cpu
from sparta.codegen.dismantle import before_after
from sparta.templates.cpu_linear.block import block_linear
from sparta.templates.cpu_linear.block_spec import (BlockLinearSpec, argument_names, dequantized_weight, pack,
                                                    quantize_rows, reference)


def rows_of(keep):
    return tuple(tuple(torch.nonzero(keep[i]).flatten().tolist()) for i in range(keep.shape[0]))


def run(spec, x, w, b=None, y=None):
    kern = build_cpu(block_linear, spec)
    packed = pack(spec, w)
    args = dict(packed, B=b)
    if spec.int8_activations:
        args["X"], args["XS"] = quantize_rows(x)
    else:
        args["X"] = x
    out = y.clone() if y is not None else torch.full((spec.m, spec.n), float("nan"))
    args["Y"] = out
    kern.fn(*[args[a] for a in argument_names(spec)])
    return out, reference(spec, x, packed, b, y), packed


CASES = [  # m, n, k, block, density, bits, dismantle, activation
    (67, 96, 64, (32, 32), 0.5, 32, "full", None),
    (5, 64, 96, (32, 32), 0.5, 32, "tile", "gelu"),
    (1, 48, 32, (16, 16), 0.6, 32, "none", "relu"),
    (130, 32, 48, (16, 16), 1.0, 32, "full", "silu"),     # 100% density
    (13, 32, 32, (32, 32), 0.0, 32, "full", None),        # 0% density: output is the bias
    (9, 24, 40, (4, 8), 0.4, 32, "tile", "tanh"),
    (7, 6, 10, (1, 1), 0.3, 32, "full", None),
    (21, 64, 64, (32, 32), 0.5, 8, "full", None),
    (4, 32, 64, (16, 16), 0.7, 8, "tile", "relu"),
    (19, 32, 64, (32, 32), 0.5, 4, "full", None),
    (3, 16, 32, (16, 16), 1.0, 4, "tile", "sigmoid"),
    # the generic kernel below two panels of rows hands block rows to the threads (decode-sized GEMMs)
    (1, 64, 64, (32, 32), 0.5, 4, "none", "gelu"),
    (6, 96, 64, (32, 32), 0.7, 8, "none", None),
    (67, 64, 96, (16, 16), 1.0, 32, "none", "silu"),
    (2, 64, 64, (32, 32), 0.0, 32, "none", None),
    (130, 64, 64, (16, 16), 0.5, 32, "none", "relu"),   # the panel path
]


@pytest.mark.parametrize("m, n, k, block, density, bits, mode, act", CASES)
def test_block_linear_matches_reference(m, n, k, block, density, bits, mode, act):
    g = torch.Generator().manual_seed(m * 31 + n)
    keep = torch.rand(n // block[0], k // block[1], generator=g) < density
    spec = BlockLinearSpec(m, n, k, block, rows_of(keep), bits, bias=True, activation=act, dismantle=mode,
                           name=f"t_{m}_{n}_{k}_{bits}_{mode}")
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    out, ref, packed = run(spec, x, w, b)
    assert not torch.isnan(out).any(), "every output element is written"
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if bits == 32:  # the packed weight is exactly the masked weight
        mask = keep.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        assert torch.equal(dequantized_weight(spec, packed), w * mask)
    else:           # quantisation error is bounded by half a step of the scale
        err = (dequantized_weight(spec, packed) - w * keep.repeat_interleave(block[0], 0)
               .repeat_interleave(block[1], 1)).abs().max()
        assert err <= w.abs().max() / (127 if bits == 8 else 7)


@pytest.mark.parametrize("symmetric, group, scale_group, mode", [(False, 16, 16, "full"), (True, 8, 8, "tile"),
                                                                 (False, 64, 0, "none")])
def test_int4_takes_fitted_scales_and_zero_points(symmetric, group, scale_group, mode):
    """Scales fitted by calibration (per group, asymmetric) are what the kernel applies, exactly."""
    from sparta.passes.quant import weight_params
    g = torch.Generator().manual_seed(group)
    m, n, k, block = 11, 64, 64, (32, 32)
    keep = torch.rand(n // 32, k // 32, generator=g) < 0.7
    keep[0, 0] = True
    spec = BlockLinearSpec(m, n, k, block, rows_of(keep), 4, bias=True, dismantle=mode, scale_group=scale_group,
                           name=f"fit4_{int(symmetric)}_{group}_{mode}")
    mask = keep.repeat_interleave(32, 0).repeat_interleave(32, 1)
    w = torch.randn(n, k, generator=g) * mask + 0.3 * mask                  # skewed: asymmetric pays off
    params = weight_params(w, 4, symmetric=symmetric, group=group, clip=torch.rand(n, generator=g) * 0.3 + 0.7)
    scale, zero = params.expand(k)
    kern = build_cpu(block_linear, spec)
    packed = pack(spec, w, scale, zero)
    assert torch.allclose(dequantized_weight(spec, packed), params.dequantize(w) * mask, atol=1e-6)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    out = torch.full((m, n), float("nan"))
    kern.fn(*[dict(packed, X=x, B=b, Y=out)[a] for a in argument_names(spec)])
    torch.testing.assert_close(out, reference(spec, x, packed, b), rtol=1e-4, atol=1e-4)


def test_int8_takes_fitted_per_channel_scales_and_refuses_others():
    from sparta.passes.quant import weight_params
    g = torch.Generator().manual_seed(8)
    w = torch.randn(32, 64, generator=g)
    spec = BlockLinearSpec(4, 32, 64, (32, 32), ((0, 1),), 8, name="fit8")
    params = weight_params(w, 8, clip=0.8)
    packed = pack(spec, w, *params.expand(64))
    assert torch.allclose(dequantized_weight(spec, packed), params.dequantize(w), atol=1e-6)
    with pytest.raises(ValueError, match="per channel"):
        pack(spec, w, *weight_params(w, 8, group=32).expand(64))
    with pytest.raises(ValueError, match="symmetric"):
        pack(spec, w, *weight_params(w, 8, symmetric=False).expand(64))


def test_accumulate_adds_into_output():
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 3, generator=g) < 0.5
    spec = BlockLinearSpec(10, 64, 96, (32, 32), rows_of(keep), accumulate=True, name="acc_test")
    x, w, y0 = torch.randn(10, 96, generator=g), torch.randn(64, 96, generator=g), torch.randn(10, 64, generator=g)
    out, ref, _ = run(spec, x, w, y=y0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_dismantling_removes_pruned_blocks_and_index_arrays():
    """Golden structural test on a tiny case: what dismantle + DCE leave behind."""
    rows = ((0, 2), ())                                 # block row 0 keeps blocks 0 and 2; row 1 nothing
    generic, _ = before_after(block_linear, BlockLinearSpec(4, 4, 6, (2, 2), rows, dismantle="none", name="g"))
    assert "P[" in generic and "C[" in generic          # the BCSR kernel reads index arrays at run time
    before, after = before_after(block_linear, BlockLinearSpec(4, 4, 6, (2, 2), rows, dismantle="full", name="d"))
    assert before.count("if T.bool(False)") == 4 and before.count("if T.bool(True)") == 2  # 6 grid blocks
    assert "T.bool(" not in after, "the compile-time guards are folded away"
    assert "C[" not in after and "P[" not in after and "C: T.Buffer" not in after
    fmas = re.findall(r"buffer\[v_3, v_4\] \+ buffer_1\[(\d), .*?\] \* W\[(\d), v_2, v_4\]", after)
    assert fmas == [("0", "0"), ("1", "1")], "one FMA nest per kept block, with constant packed indices"
    copies = re.findall(r"= X\[v_1, (.*?)\]", after)
    assert copies == ["v_2", "v_2 + 4"], "only the block columns some kept block reads are packed"
    tile, _ = before_after(block_linear, BlockLinearSpec(4, 4, 6, (2, 2), rows, dismantle="tile", name="t"))
    assert "C[" in tile and "P: T.Buffer" not in tile and "if T.bool" not in tile


def test_bad_specs():
    with pytest.raises(ValueError, match="multiples"):
        BlockLinearSpec(4, 30, 32, (16, 16), ((),))
    with pytest.raises(ValueError, match="bits"):
        BlockLinearSpec(4, 16, 16, (16, 16), ((0,),), weight_bits=6)
    with pytest.raises(ValueError, match="dismantle"):
        BlockLinearSpec(4, 16, 16, (16, 16), ((0,),), dismantle="half")


def test_generic_kernel_is_shared_by_every_sparsity_of_one_shape():
    """dismantle="none" reads the block structure at run time: one build serves all layers."""
    g = torch.Generator().manual_seed(11)
    built = []
    for density in (0.0, 0.3, 1.0):
        keep = torch.rand(3, 2, generator=g) < density
        spec = BlockLinearSpec(9, 96, 64, (32, 32), rows_of(keep), bias=True, activation="relu", dismantle="none")
        spec = BlockLinearSpec(**{**spec.key(), "rows": spec.rows, "name": spec.generic_name()})
        x, w, b = torch.randn(9, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
        out, ref, _ = run(spec, x, w, b)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        built.append(build_cpu(block_linear, spec))
    assert len({b.key for b in built}) == 1 and all(b.cached for b in built[1:])


@pytest.mark.parametrize("mode, bits, block, act", [("none", 32, (32, 32), "gelu"), ("tile", 32, (16, 16), None),
                                                    ("full", 8, (32, 32), "relu"), ("none", 4, (32, 32), None),
                                                    ("none", 8, (16, 16), "silu")])
def test_one_kernel_serves_every_row_count(mode, bits, block, act):
    """``m=0``: M is an argument of the kernel; one build runs 1 row (the row-parallel path of the generic
    kernel), odd counts (tail rows one at a time) and several panels, each against the reference."""
    g = torch.Generator().manual_seed(5)
    n, k = 96, 64
    keep = torch.rand(n // block[0], k // block[1], generator=g) < 0.5
    spec = BlockLinearSpec(0, n, k, block, rows_of(keep), bits, bias=True, activation=act, dismantle=mode,
                           name=f"t_anyrows_{mode}_{bits}_{block[0]}")
    kern = build_cpu(block_linear, spec)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = pack(spec, w)
    for m in (1, 3, 4, 67, 130, 257):
        x = torch.randn(m, k, generator=g)
        args = dict(packed, B=b, Y=torch.full((m, n), float("nan")))
        if spec.int8_activations:
            args["X"], args["XS"] = quantize_rows(x)
        else:
            args["X"] = x
        kern.fn(*[args[a] for a in argument_names(spec)])
        torch.testing.assert_close(args["Y"], reference(spec, x, packed, b), rtol=1e-4, atol=1e-4, msg=f"{m} rows")
