"""RMSNorm (the norm family's ``kind="rms"``) against copy bandwidth and torch, in one process.

    python benchmarks/bench_cuda_rmsnorm.py --build [DIR]               # here (TVM + nvcc); DIR: artifacts/rmsnorm/
    python benchmarks/bench_cuda_rmsnorm.py [--dir DIR] [--out FILE]    # on the GPU machine (torch + cuda-bindings)

At 4096 rows x 4096 (a 7B decoder's width, a 4096-token prefill), bf16 and fp16, kernel time from CUDA graphs over
enough input sets to defeat L2: ``sparta_rms`` (reads x, writes y) against the copy of as many bytes (its floor) and
torch's ``F.rms_norm``; the pre-norm residual step ``h = x + r; y = rmsnorm(h)`` as ``sparta_res`` (one kernel: reads x
and r, writes h and y) against torch's two ops eager (``F.rms_norm`` and Hugging Face's LlamaRMSNorm formula) and the
two ops under ``torch.compile`` (returning the sum too, as a decoder reads it on). Torch's two ops move 5 tensors
of bytes (the add reads two and writes one, the norm reads one and writes one), the fused kernel 4: at the bandwidth
floor the fusion can save at most 5/4.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from common import build_or_time, gpu_kernel_us, save  # noqa: E402  (benchmarks/ is the script's folder)

OUT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda")
           ).parent / "rmsnorm"
M, N, EPS = 4096, 4096, 1e-6
DTYPES = {"bf16": ("bfloat16", torch.bfloat16), "fp16": ("float16", torch.float16)}


def specs() -> dict:
    from sparta.templates.norm.spec import LayerNormSpec, pick_threads
    out = {}
    for tag, (name, _) in DTYPES.items():
        common = dict(kind="rms", bias=False, eps=EPS, threads=pick_threads(N), dtype=name)
        out[f"rms_{tag}"] = LayerNormSpec(0, N, **common, name=f"rms_norm_Mx{N}_{tag}")
        out[f"rms_res_{tag}"] = LayerNormSpec(0, N, residual=True, residual_out=True, **common,
                                              name=f"rms_norm_Mx{N}_res_out_{tag}")
    return out


def build(folder: Path, jobs: int) -> None:
    from sparta.codegen.cuda_build import build_folders
    build_folders(specs(), folder, jobs, log=lambda line: print(line, flush=True))


def hf_rms(h, w):
    """Hugging Face's LlamaRMSNorm.forward."""
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def bench(tag: str, root: Path) -> dict:
    from sparta.templates.norm.runtime import LayerNormOp
    from sparta.templates.norm.spec import LayerNormSpec, rms_norm_ref
    dtype = DTYPES[tag][1]
    sets = 3
    xs = [(torch.randn(M, N, device="cuda") * 2 + 0.5).to(dtype) for _ in range(sets)]
    rs = [torch.randn(M, N, device="cuda").to(dtype) for _ in range(sets)]
    w = (torch.rand(N, device="cuda") + 0.5).to(dtype)
    ops = {}
    for kind in ("rms", "rms_res"):
        folder = root / f"{kind}_{tag}"
        ops[kind] = LayerNormOp(folder, LayerNormSpec(**json.loads((folder / "spec.json").read_text())), w)
    y = ops["rms"](xs[0])
    y2, h2 = ops["rms_res"](xs[0], rs[0])
    ref, ref2 = rms_norm_ref(xs[0], w, EPS), rms_norm_ref(xs[0] + rs[0], w, EPS)
    err = {"rms": (y.float() - ref.float()).abs().max().item(),
           "rms_res": (y2.float() - ref2.float()).abs().max().item(), "sum_exact": bool(torch.equal(h2, xs[0] + rs[0]))}
    dst = [torch.empty_like(x) for x in xs]
    def add_norm(x, r):                 # the decoder's step: the sum is the residual stream, read again later
        h = x + r
        return h, F.rms_norm(h, (N,), w, EPS)
    two_ops = torch.compile(add_norm)
    fns = {"copy": lambda i: dst[i].copy_(xs[i]),
           "sparta_rms": lambda i: ops["rms"](xs[i]),
           "torch_rms_norm": lambda i: F.rms_norm(xs[i], (N,), w, EPS),
           "sparta_res": lambda i: ops["rms_res"](xs[i], rs[i]),
           "torch_add+rms_norm": lambda i: F.rms_norm(xs[i] + rs[i], (N,), w, EPS),
           "torch_add+hf_rms": lambda i: hf_rms(xs[i] + rs[i], w),
           "compiled_add+rms_norm": lambda i: two_ops(xs[i], rs[i])}
    us = {k: gpu_kernel_us(fn, sets) for k, fn in fns.items()}
    nbytes = M * N * xs[0].element_size()
    copy_gbs = 2 * nbytes / us["copy"] / 1e3
    rms_gbs = 2 * nbytes / us["sparta_rms"] / 1e3
    res_gbs = 4 * nbytes / us["sparta_res"] / 1e3
    return {"dtype": tag, "rows": M, "width": N, "us": us, "max_abs_err": err, "copy_GBps": copy_gbs,
            "sparta_rms_GBps": rms_gbs, "sparta_rms_of_copy": rms_gbs / copy_gbs,
            "sparta_res_GBps": res_gbs, "sparta_res_of_copy": res_gbs / copy_gbs,
            "res_vs_torch_two_ops": us["torch_add+rms_norm"] / us["sparta_res"],
            "res_vs_hf_two_ops": us["torch_add+hf_rms"] / us["sparta_res"],
            "res_vs_compiled_two_ops": us["compiled_add+rms_norm"] / us["sparta_res"],
            "two_ops_bytes_floor_ratio": 5 / 4}


def main():
    args = build_or_time(__doc__, OUT, build)
    if args is None:
        return
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    rows = [bench(tag, Path(args.dir)) for tag in DTYPES]
    for r in rows:
        print(json.dumps(r), flush=True)
    print(f"wrote {save('rmsnorm', {'rows': rows})}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
