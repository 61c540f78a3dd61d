"""Saved CUDA models (``tests/fixtures/saved_models.py``) through torch.compile on a GPU: every sparta op passes
opcheck, ``fullgraph=True`` compiles without a graph break, and Inductor and CUDA graphs (``reduce-overhead``) give
the eager model's output."""


import pytest
import torch

from sparta.sampling import random_inputs

from fixtures.artifacts import MISSING, ROOT
SAVED = sorted(p.name for p in ROOT.glob("saved_*") if (p / "sparta.json").is_file()) if ROOT.is_dir() else []
# one model per kernel family and per int8 hand-over (LayerNorm → codes, linear → codes → linear)
COMPILED = [n for n in ("saved_mlp", "saved_mlp_w8a8_static", "saved_norm_w8a8", "saved_decode_w4a16",
                        "saved_decode_w8a8") if n in SAVED]
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not SAVED, reason=MISSING + f"no saved models in {ROOT}")]


def load(name, inductor=False):
    import sparta
    return sparta.load(ROOT / name, inductor=inductor).to("cuda")


def assert_outputs_close(got, want):
    """Each output within 2% of the largest magnitude of its reference."""
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, g in zip(want, got):
        scale = float(w.float().abs().max()) or 1.0
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * scale)


def inputs_of(model, seed):
    return [t.cuda() for t in random_inputs(model.graph, seed=seed)]


@pytest.mark.parametrize("name", SAVED)
def test_every_kernel_op_passes_opcheck(name, monkeypatch):
    from sparta.runtime.ops import KernelModule
    model = load(name)
    calls, original = {}, KernelModule.call_kernel

    def record(self, *inputs):   # the first call of each family, on what the model really hands it
        calls.setdefault(self.kernel_family, (self, [t.clone() for t in inputs]))
        return original(self, *inputs)
    monkeypatch.setattr(KernelModule, "call_kernel", record)
    with torch.no_grad():
        model(*inputs_of(model, 0))
    assert calls
    for family, (module, inputs) in calls.items():
        op = getattr(torch.ops.sparta, family).default
        torch.library.opcheck(op, (module.kernel_key, inputs, module.kernel_weights()))


@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_matches_eager(name, mode):
    model = load(name)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    with torch.no_grad():
        for seed in (1, 2, 3):      # reduce-overhead: warm-up, capture, replay on new data
            xs = inputs_of(model, seed)
            want, got = model(*xs), compiled(*xs)
            assert_outputs_close(got, want)


@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_loaded_model_runs_under_cuda_graphs_by_default(name, mode):
    """``sparta.load`` of a CUDA model runs its calls through torch.compile and one CUDA graph per shape (the third
    stage; or torch's reduce-overhead on request): same outputs as the fx module run eagerly, call after call, and
    it verifies that way."""
    torch._dynamo.reset()
    model, eager = load(name, inductor=mode), load(name)
    assert model.inductor == (mode or "cudagraph") and eager.inductor is None
    with torch.no_grad():
        for seed in (1, 2, 3):
            xs = inputs_of(model, seed)
            want, got = eager(*xs), model(*xs)
            assert_outputs_close(got, want)
    model.verify(trials=2)
