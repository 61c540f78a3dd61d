"""The joint plan on the CPU: calibration choosing each linear's blocks kept and bits together, against bits alone.

    python benchmarks/bench_joint_plan.py [--sigma 1.0] [--tolerance 1e-2] [--rows 128]

A BERT-base FFN (768 → 3072, GELU, → 768; fp32) whose weights are Gaussian with one scale per 32×32 block drawn
log-normal(0, ``sigma``): block norms spread as a trained layer's do (synthetic: no checkpoint is reachable here; a
random layer of uniform scale has no block to spare). sparta compiles it three ways on calibration batches of
``rows`` tokens: no calibration (dense fp32 kernels), calibrated bits (``quant_tolerance=tolerance``) and the joint plan
(``densities`` 0.5, 0.25 and 0.1 tried beside the bits). Peers in one process, calls interleaved, medians: the model in
eager torch and under ``torch.compile``. Accuracy: relative output MSE against the fp32 model on a batch calibration
never saw.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
from common import interleaved, save

import sparta


def ffn(sigma: float, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768)).eval()
    with torch.no_grad():
        for lin in (model[0], model[2]):
            n, k = lin.weight.shape
            scale = torch.randn(n // 32, k // 32, generator=g).mul(sigma).exp()
            w = torch.randn(n, k, generator=g) * scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
            lin.weight.copy_(w * (k ** -0.5) / w.std())
    return model


def rel_mse(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((got - ref).pow(2).sum() / ref.pow(2).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sigma", type=float, default=1.0, help="spread of the block scales (log-normal)")
    ap.add_argument("--tolerance", type=float, default=1e-2, help="relative output MSE one op may add")
    ap.add_argument("--rows", type=int, default=128, help="tokens a call")
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    model = ffn(args.sigma)
    g = torch.Generator().manual_seed(1)
    calib = [(torch.randn(args.rows, 768, generator=g),) for _ in range(4)]
    x = torch.randn(args.rows, 768, generator=g)
    compiled, seconds = {}, {}
    for name, tol in (("sparta_fp32", None), ("sparta_bits", {"tolerance": args.tolerance}),
                      ("sparta_joint", {"tolerance": args.tolerance, "densities": (0.5, 0.25, 0.1)})):
        t0 = time.perf_counter()
        kw = {} if tol is None else {"calibration": calib, "quant_tolerance": {**tol, "progress": False}}
        compiled[name] = sparta.compile(model, {}, calib[0], target="cpu", **kw)
        seconds[name] = time.perf_counter() - t0
    inductor = torch.compile(model)
    with torch.no_grad():
        ref = model(x)
        inductor(x)
        fns = {"eager": lambda: model(x), "torch_compile": lambda: inductor(x),
               **{k: (lambda m=m: m(x)) for k, m in compiled.items()}}
        ms = interleaved(fns, args.reps)
        err = {k: rel_mse(ref, m(x)) for k, m in compiled.items()}
    choices = {}
    for k in ("sparta_bits", "sparta_joint"):
        report = compiled[k].quantization
        choices[k] = {d.tensor: {"bits": d.bits, "density": d.density, "added": d.error,
                                 "reverted": d.reverted} for d in report.decisions}
    print(f"FFN 768-3072-768, {args.rows} rows, block scales log-normal sigma {args.sigma}, tolerance {args.tolerance}")
    for k, v in ms.items():
        extra = f", rel. MSE {err[k]:.2e}, compile {seconds[k]:.0f} s" if k in err else ""
        print(f"  {k:<14} {v:7.2f} ms  {ms['eager'] / v:5.2f}x eager{extra}")
    for k, c in choices.items():
        print(f"  {k}: " + "; ".join(f"{t} {v['density']:.0%} of blocks at {v['bits']} bits (adds {v['added']:.1e})"
                                      for t, v in c.items()))
    path = save("joint_plan", {"sigma": args.sigma, "tolerance": args.tolerance, "rows": args.rows, "ms": ms,
                               "rel_mse": err, "compile_s": seconds, "choices": choices,
                               "plans": {k: m.plan_report() for k, m in compiled.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
