"""CUDA kernels launched through sparta's TVM-free runtime (cuda-bindings), on a GPU.

The kernels are built beforehand on a machine with TVM (``python benchmarks/build_cuda_kernels.py``)
and found in ``$SPARTA_CUDA_ARTIFACTS`` (default ``artifacts/cuda``); without a GPU or the
artifacts these tests skip.
"""

import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts" / "cuda"))
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not (ROOT / "index.json").is_file(), reason=f"no built kernels in {ROOT}")]


def _gemms():
    return json.loads((ROOT / "index.json").read_text()) if (ROOT / "index.json").is_file() else {}


def _inputs(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).half()
    w = torch.randn(n, k, device="cuda", generator=g).half()
    return x, w


@pytest.mark.parametrize("name", sorted(_gemms()))
def test_gemm_matches_torch(name):
    from sparta.runtime.cuda import CudaKernel
    from sparta.templates.cuda_gemm import reference
    kern = CudaKernel(ROOT / name)
    s = _gemms()[name]
    x, w = _inputs(s["m"], s["n"], s["k"], 0)
    y = torch.full((s["m"], s["n"]), float("nan"), device="cuda")
    args = {"X": x, "W": w, "Y": y}
    kern(*[args[a["name"]] for a in kern.launch["args"]])
    torch.cuda.synchronize()
    ref = reference(x, w)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3 * s["k"] ** 0.5)


def test_cuda_graph_capture_and_replay():
    from sparta.runtime.cuda import CudaKernel
    kern = CudaKernel(ROOT / "gemm_small")
    s = _gemms()["gemm_small"]
    x, w = _inputs(s["m"], s["n"], s["k"], 1)
    y = torch.zeros(s["m"], s["n"], device="cuda")
    args = {"X": x, "W": w, "Y": y}
    order = [a["name"] for a in kern.launch["args"]]
    kern(*[args[a] for a in order])                  # load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(*[args[a] for a in order])
    x.copy_(torch.randn_like(x))
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x.float() @ w.float().t(), rtol=2e-3, atol=2e-2)


def test_bad_arguments_raise_clear_errors():
    from sparta.runtime.cuda import CudaKernel, CudaRuntimeError
    kern = CudaKernel(ROOT / "gemm_small")
    s = _gemms()["gemm_small"]
    x, w = _inputs(s["m"], s["n"], s["k"], 2)
    y = torch.zeros(s["m"], s["n"], device="cuda")
    with pytest.raises(CudaRuntimeError, match="takes 3 tensors"):
        kern(x, w)
    with pytest.raises(CudaRuntimeError, match="shape"):
        args = {"X": x[:, :-1].contiguous(), "W": w, "Y": y}
        kern(*[args[a["name"]] for a in kern.launch["args"]])
    with pytest.raises(CudaRuntimeError, match="CUDA tensor"):
        args = {"X": x.cpu(), "W": w, "Y": y}
        kern(*[args[a["name"]] for a in kern.launch["args"]])


def test_missing_arch_and_corrupt_cubin(tmp_path):
    import shutil
    from sparta.runtime.cuda import CudaKernel, CudaRuntimeError, device_arch
    folder = tmp_path / "k"
    shutil.copytree(ROOT / "gemm_small", folder)
    launch = json.loads((folder / "launch.json").read_text())
    arch = device_arch()
    info = launch["cubins"][arch]
    (folder / info["file"]).write_bytes(b"not a cubin")
    kern = CudaKernel(folder)
    s = _gemms()["gemm_small"]
    x, w = _inputs(s["m"], s["n"], s["k"], 3)
    args = {"X": x, "W": w, "Y": torch.zeros(s["m"], s["n"], device="cuda")}
    with pytest.raises(CudaRuntimeError, match="SHA-256"):
        kern(*[args[a["name"]] for a in kern.launch["args"]])
    del launch["cubins"][arch]
    (folder / "launch.json").write_text(json.dumps(launch))
    with pytest.raises(CudaRuntimeError, match=f"no cubin for {arch}"):
        CudaKernel(folder)(*[args[a["name"]] for a in launch["args"]])
