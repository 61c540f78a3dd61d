"""What the fused activation costs in the ``bsr_linear`` epilogue, on BERT's FFN1 (4096×3072×768).

    python benchmarks/bench_cuda_act.py --build       # here (TVM): kernels into artifacts/cuda/act_*
    python benchmarks/bench_cuda_act.py               # on the GPU: side by side, one process

Two kernels compile() builds for FFN1 (fp16 32×32 blocks at 90% sparsity; W8A8 64×64 blocks with the int8
requantising epilogue at 68%, the density of a 64-block cover of BERT's 90%-pruned 32-block mask), each with
no activation, ReLU, GELU (tanh form) and exact GELU (``gelu_erf``). Same weights, mask and inputs per kernel
family; 4 rotating input sets (CUDA graphs); each output checked against the torch reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_mask, save  # noqa: E402

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
FFN1 = (4096, 3072, 768)
ACTS = ("none", "relu", "gelu_tanh", "gelu")
FAMILIES = {"b32": (dict(dtype="float16"), 32, 90), "i8_b64_q8": (dict(dtype="int8", out="int8"), 64, 68)}
SETS = 4


def specs() -> dict:
    from sparta.target import load_target
    from sparta.templates.bsr_linear.spec import BsrSpec
    CUDA = load_target("cuda")
    return {f"act_ffn1_{fam}_{act}": BsrSpec(*FFN1, act=act, **kw, **CUDA.tiles("fp16_tiles", blk))
            for fam, (kw, blk, _) in FAMILIES.items() for act in ACTS}


def build(jobs: int) -> None:
    from sparta.codegen.cuda_build import build_folders
    build_folders(specs(), ROOT, jobs, log=lambda line: print(line, flush=True))


def run_family(fam: str) -> dict:
    from bench_cuda_bsr import measure
    from sparta.templates.bsr_linear.runtime import BsrLinearOp, load_spec
    from sparta.templates.bsr_linear.spec import reference, reference_int8
    from sparta.templates.quant.spec import quantize_rows

    (kw, blk, sparsity), (m, n, k) = FAMILIES[fam], FFN1
    int8 = kw["dtype"] == "int8"
    xs = [torch.randn(m, k, device="cuda").half() for _ in range(SETS)]
    xq = [quantize_rows(x) for x in xs]
    w, b = torch.randn(n, k, device="cuda").half(), torch.randn(n, device="cuda").half()
    mask = bench_mask(-(-n // blk), -(-k // blk), 1 - sparsity / 100, f"act-ffn1-{blk}-{sparsity}")
    wq = quantize_rows(w)
    fns, errs = {}, {}
    for folder in sorted(ROOT.glob(f"act_ffn1_{fam}_*"), key=lambda f: len(f.name)):
        label = folder.name[len(f"act_ffn1_{fam}_"):]        # the activation (and any variant suffix)
        spec = load_spec(folder)
        act = spec.act
        if int8:
            ref = reference_int8(*xq[0], *wq, mask, b, act, blk, blk).float()
            scale = float(ref.abs().max()) / 127
            codes = reference_int8(*xq[0], *wq, mask, b, act, blk, blk, scale)
            op = BsrLinearOp(folder, spec, w, mask, b, out_scale=scale)
            ys = [torch.empty(m, n, dtype=torch.int8, device="cuda") for _ in range(SETS)]
            op.int8(*xq[0], out=ys[0])
            errs[label] = {"max_code_diff": (ys[0].int() - codes.int()).abs().max().item()}
            fns[label] = (lambda op, ys: lambda i: op.int8(*xq[i], out=ys[i]))(op, ys)
        else:
            ref = reference(xs[0], w, mask, b, act, blk, blk).float()
            op = BsrLinearOp(folder, spec, w, mask, b)
            ys = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(SETS)]
            op(xs[0], out=ys[0])
            errs[label] = {"max_rel_err": ((ys[0].float() - ref).abs().max() / ref.abs().max()).item()}
            fns[label] = (lambda op, ys: lambda i: op(xs[i], out=ys[i]))(op, ys)
    res = measure(fns, SETS)
    base = res.get("none", {}).get("kernel_us")
    for act, r in res.items():
        r.update(errs[act])
        if base and "kernel_us" in r:
            r["extra_us"] = r["kernel_us"] - base
    print(f"FFN1 {fam} {sparsity}%: " + " | ".join(
        f"{a} {r['kernel_us']:.1f} us" + (f" (+{r['extra_us']:.1f})" if a != "none" else "") for a, r in res.items()
        if "kernel_us" in r), flush=True)
    return {"family": fam, "block": blk, "sparsity": sparsity, "m": m, "n": n, "k": k, "results": res}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true", help="build the kernels (needs TVM), do not run")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    if args.build:
        build(args.jobs)
        return
    rows = [run_family(f) for f in FAMILIES]
    print("wrote", save("cuda_act", {"rows": rows}))


if __name__ == "__main__":
    main()
