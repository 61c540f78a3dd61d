"""The CPU epilogue's vector activations: their torch twins against torch's float64 functions, and the TIR built by
TVM (LLVM, vectorised) against the twins."""

import math

import pytest
import torch

from sparta.templates.cpu_linear import fast_math

EXACT = {"gelu": lambda x: torch.nn.functional.gelu(x), "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid,
         "tanh": torch.tanh}


def sweep() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    edge = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 4.0, -4.0, 87.0, -87.0, 88.5, -88.5, 1e4, -1e4, 3.4e38, -3.4e38])
    return torch.cat([torch.linspace(-30, 30, 200_001), torch.randn(100_000, generator=g) * 8, edge])


def test_erf_and_exp_are_within_their_bounds():
    x = sweep()
    assert (fast_math.erf(x).double() - torch.erf(x.double())).abs().max() <= fast_math.BOUNDS["erf"]
    y = x.clamp(-87, 88)
    rel = (fast_math.exp(y).double() / torch.exp(y.double()) - 1).abs().max()
    assert rel <= fast_math.BOUNDS["exp"], rel


@pytest.mark.parametrize("name", sorted(EXACT))
def test_activations_are_within_their_bounds(name):
    x = sweep()
    got, ref = fast_math.activation(name, x).double(), EXACT[name](x.double())
    err = ((got - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    assert err <= fast_math.BOUNDS[name], err
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("name", sorted(EXACT))
def test_the_tir_matches_its_torch_twin(name):
    pytest.importorskip("tvm")
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    from sparta.codegen.tvm_env import cpu_target, tvm
    n = 1031                                              # odd: a vector tail
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("act")
            T.func_attr({"tirx.noalias": True})
            x_buf = T.arg("X", T.buffer((n,), "float32"))
            y_buf = T.arg("Y", T.buffer((n,), "float32"))
            with T.serial(0, n // 8) as i:
                with T.vectorized(0, 8) as j:
                    T.buffer_store(y_buf, fast_math.tir_activation(name, x_buf[i * 8 + j]), [i * 8 + j])
            with T.serial(0, n % 8) as i:
                T.buffer_store(y_buf, fast_math.tir_activation(name, x_buf[n // 8 * 8 + i]), [n // 8 * 8 + i])
    act = ib.get()
    t = tvm()
    fn = t.compile(t.IRModule({"act": act}), target=cpu_target())["act"]
    x = torch.cat([torch.linspace(-12, 12, n - 7), torch.tensor([0.0, 4.0, -4.0, 90.0, -90.0, 1e5, -1e5])])
    y = torch.empty(n)
    fn(x, y)
    torch.testing.assert_close(y, fast_math.activation(name, x), rtol=2e-6, atol=2e-6)
    assert math.isfinite(float(y.abs().max()))
