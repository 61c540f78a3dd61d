import pytest
import torch

from sparta.codegen.build import build_cpu
from sparta.templates.cpu_linear.fine import fine_linear
from sparta.templates.cpu_linear.fine_spec import argument_names, dense_weight, pack, reference, spec_from_weight


@pytest.mark.parametrize("m, n, k, density, mode, act", [
    (37, 20, 30, 0.2, "full", "gelu"),
    (70, 24, 40, 0.1, "tile", None),
    (1, 9, 13, 1.0, "tile", "relu"),    # 100%
    (33, 7, 5, 0.0, "tile", None),      # 0%
    (64, 16, 16, 0.5, "full", None),
])
def test_fine_linear_matches_reference(m, n, k, density, mode, act):
    g = torch.Generator().manual_seed(n * 7 + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    mask = torch.rand(n, k, generator=g) < density
    spec = spec_from_weight(m, w, mask, mode, bias=True, activation=act, name=f"fine_t_{m}_{n}_{k}_{mode}")
    kern = build_cpu(fine_linear, spec)
    packed = pack(spec, w)
    y = torch.full((m, n), float("nan"))
    args = {"X": x, "B": b, "Y": y, **packed}
    kern.fn(*[args[a] for a in argument_names(spec)])
    torch.testing.assert_close(y, reference(spec, x, w, b), rtol=1e-4, atol=1e-4)
    assert torch.equal(dense_weight(spec, packed), w * mask)


def test_full_needs_values():
    with pytest.raises(ValueError, match="values"):
        from sparta.templates.cpu_linear.fine_spec import FineLinearSpec
        FineLinearSpec(2, 1, 2, ((0,),), dismantle="full")


@pytest.mark.parametrize("mode", ["full", "tile"])
def test_one_fine_kernel_serves_every_row_count(mode):
    """``m=0``: one build runs any number of rows (whole panels in parallel, the rest one row at a time)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(20, 30, generator=g), torch.randn(20, generator=g)
    mask = torch.rand(20, 30, generator=g) < 0.2
    spec = spec_from_weight(0, w, mask, mode, bias=True, activation="gelu", name=f"fine_anyrows_{mode}")
    kern = build_cpu(fine_linear, spec)
    packed = pack(spec, w)
    for m in (1, 5, 16, 37, 70):
        x = torch.randn(m, 30, generator=g)
        args = {"X": x, "B": b, "Y": torch.full((m, 20), float("nan")), **packed}
        kern.fn(*[args[a] for a in argument_names(spec)])
        torch.testing.assert_close(args["Y"], reference(spec, x, w, b), rtol=1e-4, atol=1e-4, msg=f"{m} rows")
