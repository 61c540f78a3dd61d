"""A catalogue of bad inputs: each raises a SpartaError (never a raw Python/torch error) that says what to do."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from models import MLP

import sparta
from sparta import CaptureError, SpartaError, TeSA, TeSAError
from sparta.errors import GraphError, QuantizationError

X = torch.randn(2, 24)


def mlp():
    return MLP().eval()


def compile_mlp(tesa=None, inputs=(X,), **kw):
    return sparta.compile(mlp(), tesa if tesa is not None else {}, inputs, **kw)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x)


class MutatesInput(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x + 1


class Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x - 1


class ReturnsInt(nn.Module):
    def forward(self, x):
        return x, 3


class TakesInts(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids):
        return self.emb(ids)


def compiled_mlp():
    return compile_mlp()


def calibrate(batches, tolerance=1e-3):
    return compile_mlp(calibration=batches, quant_tolerance=tolerance)


CASES = [
    # the model
    ("model is an int", lambda: sparta.compile(3, {}, (X,)), CaptureError, "cannot capture a int"),
    ("model is None", lambda: sparta.compile(None, {}, (X,)), CaptureError, "cannot capture a NoneType"),
    ("model is a function", lambda: sparta.compile(torch.relu, {}, (X,)), CaptureError, "torch.nn.Module"),
    ("model is a missing .onnx", lambda: sparta.compile("missing.onnx", {}, (X,)), CaptureError, "cannot read"),
    ("model is a class, not an instance", lambda: sparta.compile(MLP, {}, (X,)), CaptureError, "torch.nn.Module"),
    ("model with data-dependent control flow", lambda: sparta.compile(Branchy(), {}, (X,)), CaptureError,
     "torch.export could not capture"),
    ("model returning an int", lambda: sparta.compile(ReturnsInt(), {}, (X,)), CaptureError, "not a tensor"),
    ("model mutating a buffer", lambda: sparta.compile(Counter().eval(), {}, (torch.randn(2, 4),)), CaptureError,
     "updates its buffer 'calls'"),
    ("model mutating its input", lambda: sparta.compile(MutatesInput(), {}, (torch.randn(2, 4),)), CaptureError,
     "writes into its input 'x'"),
    # example inputs
    ("no example inputs", lambda: sparta.compile(mlp(), {}), CaptureError, "missing a required argument.*example_inputs"),
    ("example inputs of the wrong width", lambda: compile_mlp(inputs=(torch.randn(2, 23),)), CaptureError,
     "torch.export could not capture"),
    ("too many example inputs", lambda: compile_mlp(inputs=(X, X)), CaptureError, "do not fit MLP.forward"),
    ("example input is a list of floats", lambda: compile_mlp(inputs=([0.1] * 24,)), CaptureError,
     "must be Tensor, not list"),
    ("example input is a numpy array", lambda: compile_mlp(inputs=(np.zeros((2, 24), np.float32),)), CaptureError,
     "example input 0 is a numpy ndarray.*torch.from_numpy"),
    ("example input is a string", lambda: compile_mlp(inputs=("text",)), CaptureError, "must be Tensor, not str"),
    ("example inputs as a dict", lambda: compile_mlp(inputs={"x": X}), CaptureError, "example_inputs must be a tuple"),
    ("int64 input to a float model", lambda: compile_mlp(inputs=(torch.ones(2, 24, dtype=torch.int64),)),
     CaptureError, "fails on the example inputs.*int64.*float32"),
    ("float64 input to a float32 model", lambda: compile_mlp(inputs=(X.double(),)), CaptureError,
     "float64.*float32"),
    ("float16 input to a float32 model", lambda: compile_mlp(inputs=(X.half(),)), CaptureError,
     "float16.*float32"),
    ("bool input to a float model", lambda: compile_mlp(inputs=(X > 0,)), CaptureError, "bool.*float32"),
    ("meta-device input", lambda: compile_mlp(inputs=(torch.empty(2, 24, device="meta"),)), CaptureError,
     "meta"),
    ("empty example input", lambda: compile_mlp(inputs=(torch.empty(0, 24),)), CaptureError, "empty"),
    ("example_kwargs not a dict", lambda: sparta.compile(mlp(), {}, (), example_kwargs=[X]), CaptureError,
     "example_kwargs must be a dict"),
    ("float ids to an embedding", lambda: sparta.compile(TakesInts().eval(), {}, (torch.rand(2, 3),)), CaptureError,
     "torch.export could not capture"),
    # initial TeSAs
    ("initial_tesa is a list", lambda: compile_mlp([TeSA.dense((48, 24))]), TeSAError, "must be a mapping"),
    ("initial_tesa is a tuple of pairs", lambda: compile_mlp((("fc1.weight", TeSA.dense((48, 24))),)), TeSAError,
     "must be a mapping"),
    ("initial_tesa is a TeSA", lambda: compile_mlp(TeSA.dense((48, 24))), TeSAError, "must be a mapping"),
    ("initial_tesa is a string", lambda: compile_mlp("fc1.weight"), TeSAError, "must be a mapping"),
    ("initial_tesa is a set", lambda: compile_mlp({"fc1.weight"}), TeSAError, "must be a mapping"),
    ("initial_tesa key is an int", lambda: compile_mlp({0: TeSA.dense((48, 24))}), TeSAError, "names.*got 0"),
    ("initial_tesa key is a module", lambda: compile_mlp({nn.Linear(1, 1): TeSA.dense((1, 1))}), TeSAError,
     "names"),
    ("unknown parameter name", lambda: compile_mlp({"fc9.weight": TeSA.dense((48, 24))}), TeSAError,
     "unknown parameter.*did you mean"),
    ("module name instead of parameter", lambda: compile_mlp({"fc1": TeSA.dense((48, 24))}), TeSAError,
     "unknown parameter.*fc1.weight"),
    ("TeSA of the transposed shape", lambda: compile_mlp({"fc1.weight": TeSA.dense((24, 48))}), TeSAError,
     "does not match"),
    ("bool mask of the wrong shape", lambda: compile_mlp({"fc1.weight": torch.ones(24, 48, dtype=torch.bool)}),
     TeSAError, "does not match"),
    ("float mask", lambda: compile_mlp({"fc1.weight": torch.ones(48, 24)}), TeSAError,
     "expected a sparta.TeSA or a bool mask.*float32"),
    ("int mask", lambda: compile_mlp({"fc1.weight": torch.ones(48, 24, dtype=torch.int64)}), TeSAError,
     "TeSA.from_bits"),
    ("numpy bool mask", lambda: compile_mlp({"fc1.weight": np.ones((48, 24), bool)}), TeSAError,
     "expected a sparta.TeSA or a bool mask.*ndarray"),
    ("None as a TeSA", lambda: compile_mlp({"fc1.weight": None}), TeSAError, "got NoneType"),
    ("a float as a TeSA", lambda: compile_mlp({"fc1.weight": 0.5}), TeSAError, "got float"),
    ("TeSA bits above 32", lambda: TeSA.from_bits(torch.full((3,), 33)), TeSAError, "0..32"),
    ("negative TeSA bits", lambda: TeSA.from_bits(torch.full((3,), -1)), TeSAError, "0..32"),
    ("float TeSA bits", lambda: TeSA.from_bits(torch.full((3,), 8.0)), TeSAError, "non-integer"),
    ("NaN TeSA bits", lambda: TeSA.from_bits(torch.tensor([float("nan")])), TeSAError, "NaN"),
    ("TeSA from a string", lambda: TeSA.from_bits("eight"), TeSAError, "tensor or array"),
    ("bool tensor as bits", lambda: TeSA.from_bits(torch.ones(3, dtype=torch.bool)), TeSAError, "from_mask"),
    # options
    ("unknown target", lambda: compile_mlp(target="tpu"), SpartaError, "unknown target 'tpu'"),
    ("target in capitals", lambda: compile_mlp(target="CUDA"), SpartaError, "unknown target 'CUDA'"),
    ("target None", lambda: compile_mlp(target=None), SpartaError, "unknown target None"),
    ("bad dismantle level", lambda: compile_mlp(dismantle="sometimes"), SpartaError, "dismantle"),
    ("propagate not a bool", lambda: compile_mlp(propagate="yes"), SpartaError, "propagate must be True or False"),
    ("verify not a bool", lambda: compile_mlp(verify="yes"), SpartaError, "verify must be True or False"),
    ("inductor='cudagraph' on the CPU", lambda: compile_mlp(target="cpu", inductor="cudagraph"), SpartaError,
     "replays CUDA graphs.*target='cuda'"),
    ("hardware profile an int", lambda: compile_mlp(profile=123), SpartaError,
     "profile must be a hardware profile JSON path or a HardwareProfile"),
    ("hardware profile a missing file", lambda: compile_mlp(profile="missing.json"), SpartaError, "missing.json"),
    ("calibration without tolerance", lambda: compile_mlp(calibration=[(X,)]), SpartaError, "needs both"),
    ("tolerance without calibration", lambda: compile_mlp(quant_tolerance=1e-3), SpartaError, "needs both"),
    ("negative tolerance", lambda: calibrate([(X,)], -1.0), QuantizationError, "tolerance"),
    ("tolerance a string", lambda: calibrate([(X,)], "small"), QuantizationError, "tolerance"),
    ("tolerance dict with an unknown option", lambda: calibrate([(X,)], {"tolerance": 1e-3, "bogus": 1}),
     QuantizationError, "bogus"),
    ("calibration batches not a list", lambda: calibrate(X), QuantizationError, "calibration"),
    ("calibration batch of the wrong shape", lambda: calibrate([(torch.randn(2, 23),)]), QuantizationError,
     "shape"),
    ("empty calibration", lambda: calibrate([]), QuantizationError, "calibration"),
    # calling the compiled model
    ("call with too many inputs", lambda: compiled_mlp()(X, X), SpartaError, "1 tensor inputs"),
    ("call with no input", lambda: compiled_mlp()(), SpartaError, "1 tensor inputs"),
    ("call with a list", lambda: compiled_mlp()([0.0] * 24), SpartaError, "tensor inputs"),
    ("call with float64", lambda: compiled_mlp()(X.double()), SpartaError, "dtype torch.float64.*float32"),
    ("call with int64", lambda: compiled_mlp()(X.long()), SpartaError, "dtype torch.int64.*float32"),
    ("call with another width", lambda: compiled_mlp()(torch.randn(2, 23)), SpartaError, "shape"),
    ("call with a meta-device input", lambda: compiled_mlp()(torch.empty(2, 24, device="meta")), SpartaError,
     "meta device.*real tensors"),
    ("call with an input that requires grad", lambda: compiled_mlp()(X.clone().requires_grad_()), SpartaError,
     "inference-only.*torch.no_grad()"),
    ("set inductor='cudagraph' on a CPU model", lambda: setattr(compiled_mlp(), "inductor", "cudagraph"),
     SpartaError, "replays CUDA graphs"),
    # profiling the compiled model
    ("profile with reps=True", lambda: compiled_mlp().profile(X, reps=True), SpartaError, "reps.*whole number"),
    ("profile with reps=0", lambda: compiled_mlp().profile(X, reps=0), SpartaError, "reps"),
    ("profile a meta-device input", lambda: compiled_mlp().profile(torch.empty(2, 24, device="meta")), SpartaError,
     "meta device"),
    # inspecting the compiled model
    ("tesa of an unknown name", lambda: compiled_mlp().tesa("fc9.weight"), GraphError, "unknown tensor"),
    ("verify with zero trials", lambda: compiled_mlp().verify(trials=0), SpartaError, "trials"),
    ("verify with a negative tolerance", lambda: compiled_mlp().verify(rtol=-1.0), SpartaError, "rtol"),
    ("save onto a file", lambda: compiled_mlp().save(__file__), SpartaError, "choose an empty or new folder"),
    ("load a missing folder", lambda: sparta.load("/nonexistent/folder"), SpartaError, "not a saved sparta model"),
    ("load trusting kernels with a string", lambda: sparta.load("/nonexistent/folder", trust_kernels="no"),
     SpartaError, "trust_kernels must be True or False"),
    ("capture with kwargs not a dict", lambda: sparta.capture(mlp(), (X,), [X]), CaptureError,
     "example_kwargs must be a dict"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_sparta_error_that_says_what_to_do(case):
    _, call, error, phrase = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=phrase):
            call()


def test_the_catalogue_is_large():
    assert len(CASES) >= 60


def test_compiled_models_run_without_autograd_only():
    """Inference only: under no_grad, inference_mode or with inputs that do not require grad the call runs; its
    outputs never pretend to carry gradients."""
    compiled, grad_x = compiled_mlp(), X.clone().requires_grad_()
    with torch.no_grad():
        expected = compiled(grad_x)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(grad_x), expected)
    out = compiled(X)
    torch.testing.assert_close(out, expected)
    assert not out.requires_grad and not expected.requires_grad


def test_a_model_in_train_mode_compiles_in_eval_mode_with_a_warning():
    model = MLP()
    model.fc1 = nn.Sequential(model.fc1, nn.Dropout(0.5))
    model.train()
    with pytest.warns(UserWarning, match="eval"):
        compiled = sparta.compile(model, {}, (X,))
    assert model.training and model.fc1[1].training, "the user's model is left as it was"
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), model(X))
