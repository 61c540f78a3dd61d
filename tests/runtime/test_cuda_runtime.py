"""sparta's TVM-free CUDA launcher (cuda-bindings): argument checks and load errors, on a GPU.

Uses the ``t_odd_gelu`` kernel built beforehand by ``python tests/fixtures/build_cuda.py``
(found in ``$SPARTA_CUDA_ARTIFACTS``, default ``artifacts/cuda``); skips without a GPU or it.
"""

import json
import shutil

import pytest
import torch

from fixtures.artifacts import MISSING, ROOT
KERNEL = ROOT / "t_odd_gelu"
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not (KERNEL / "launch.json").is_file(), reason=MISSING + f"no built kernel {KERNEL}")]


def _args():
    from sparta.templates.bsr_linear.runtime import load_spec
    from sparta.templates.bsr_linear.packing import pack_weight
    spec = load_spec(KERNEL)
    w = torch.randn(spec.n, spec.k, device="cuda").half()
    wp, tab = pack_weight(w, spec, torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool))
    return spec, {"X": torch.randn(spec.m, spec.k, device="cuda").half(), "Wp": wp.view(-1),
                  "B": torch.randn(spec.n, device="cuda").half(), "Tab": tab,
                  "Y": torch.empty(spec.m, spec.n, dtype=torch.float16, device="cuda")}


def test_bad_arguments_raise_clear_errors():
    from sparta.runtime.cuda import CudaKernel, CudaRuntimeError
    kern = CudaKernel(KERNEL)
    spec, args = _args()
    with pytest.raises(CudaRuntimeError, match="takes 5 tensors"):
        kern(args["X"], args["Y"])
    with pytest.raises(CudaRuntimeError, match="missing arguments"):
        kern.call(X=args["X"])
    with pytest.raises(CudaRuntimeError, match="shape"):
        kern.call(**{**args, "X": args["X"][:, :-8].contiguous()})
    with pytest.raises(CudaRuntimeError, match="CUDA tensor"):
        kern.call(**{**args, "X": args["X"].cpu()})
    with pytest.raises(CudaRuntimeError, match="float16"):
        kern.call(**{**args, "X": args["X"].float()})


def test_missing_arch_and_corrupt_cubin(tmp_path):
    from sparta.runtime.cuda import CudaKernel, CudaRuntimeError, device_arch
    folder = tmp_path / "k"
    shutil.copytree(KERNEL, folder)
    launch = json.loads((folder / "launch.json").read_text())
    arch = device_arch()
    (folder / launch["cubins"][arch]["file"]).write_bytes(b"not a cubin")
    _, args = _args()
    with pytest.raises(CudaRuntimeError, match="SHA-256"):
        CudaKernel(folder).call(**args)
    del launch["cubins"][arch]
    (folder / "launch.json").write_text(json.dumps(launch))
    with pytest.raises(CudaRuntimeError, match=f"no cubin for {arch}"):
        CudaKernel(folder).call(**args)
