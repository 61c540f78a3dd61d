"""LayerNorm (fp16) and LayerNorm + per-token int8 quantisation: sparta's kernel against torch, in one process.

    python benchmarks/build_cuda_kernels.py          # here (TVM + nvcc): artifacts/cuda/ln_*, q_ln_*
    python benchmarks/bench_cuda_layernorm.py        # on the GPU machine

Rows (kernel-only: CUDA graphs over enough input sets to defeat L2; eager: host wall time per call):
``torch`` = ``F.layer_norm`` in fp16; ``sparta_fp16`` = the kernel emitting ``Y``; for a LayerNorm that
feeds W8A8 linears, ``torch+quant_torch`` / ``torch+quant_sparta`` = torch's LayerNorm then the per-token
quantiser in torch ops / sparta's one-pass kernel (what compile ran before the fusion), against
``sparta_int8`` (codes + scales only: a pre-LN block) and ``sparta_both`` (fp16 too: post-LN, the residual
reads it). Post-LN residual: ``torch_add+torch`` = ``F.layer_norm(x + r)`` (the add a pass of its own) against
``sparta_fp16_res``, the kernel reading ``x`` and ``r`` (its floor: two fp16 reads and one write).
Floor: bytes moved (fp16 in; fp16 and/or int8 out) at the measured copy bandwidth.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_cuda_bsr import ceilings, measure  # noqa: E402  (benchmarks/ is the script's folder)
from common import save  # noqa: E402
from sparta.templates.norm.runtime import LayerNormOp
from sparta.templates.quant.runtime import RowQuantizer
from sparta.templates.norm.spec import LayerNormSpec, layer_norm_ref
from sparta.templates.quant.spec import quantize_rows

ROOT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda"))
OUT_BYTES = {"fp16": 2, "int8": 1, "both": 3}       # written per element, besides the fp16 read
LN_SHAPES = ((4096, 768), (16384, 1024), (4096, 4096))  # BERT-base, BERT-large x4 tokens, Llama-7B width


def run(m: int, n: int, bw: float) -> dict:
    sets = max(2, math.ceil(200e6 / (m * n * 7)))      # every set's inputs and outputs: > 3x the L2
    xs = [(torch.randn(m, n, device="cuda") * 2 + 0.5).half() for _ in range(sets)]
    w = (torch.rand(n, device="cuda") + 0.5).half()
    b = torch.randn(n, device="cuda").half()
    fns = {"torch": lambda i: F.layer_norm(xs[i], (n,), w, b)}
    fns["torch+quant_torch"] = lambda i: quantize_rows(F.layer_norm(xs[i], (n,), w, b))
    if (ROOT / f"q_ln_{m}x{n}").is_dir():
        quantizer = RowQuantizer(ROOT / f"q_ln_{m}x{n}")
        fns["torch+quant_sparta"] = lambda i: quantizer(F.layer_norm(xs[i], (n,), w, b))
    checks = {}
    ref = layer_norm_ref(xs[0], w, b, 1e-5)
    for out in OUT_BYTES:
        folder = ROOT / f"ln_{m}x{n}_{out}"
        if not folder.is_dir():
            continue
        spec = LayerNormSpec(**json.loads((folder / "spec.json").read_text()))
        op = LayerNormOp(folder, spec, w, b)
        fns[f"sparta_{out}"] = lambda i, op=op: op(xs[i])
        got = op(xs[0])
        got = got if isinstance(got, tuple) else (got,)
        check = {}
        if out != "int8":
            check["max_abs_err"] = (got[0].float() - ref.float()).abs().max().item()
        if out != "fp16":
            rq, rs = quantize_rows(ref)
            check["codes_off_by_more_than_1"] = int(((got[-2].int() - rq.int()).abs() > 1).sum())
            check["codes_differing"] = float((got[-2] != rq).float().mean())
            check["scale_max_rel_err"] = ((got[-1] - rs).abs() / rs).max().item()
        checks[out] = check
    res = [(torch.randn(m, n, device="cuda")).half() for _ in range(sets)]
    fns["torch_add+torch"] = lambda i: F.layer_norm(xs[i] + res[i], (n,), w, b)
    folder = ROOT / f"ln_{m}x{n}_fp16_res"
    if folder.is_dir():
        op = LayerNormOp(folder, LayerNormSpec(**json.loads((folder / "spec.json").read_text())), w, b)
        fns["sparta_fp16_res"] = lambda i, op=op: op(xs[i], res[i])
        got = op(xs[0], res[0])
        checks["fp16_res"] = {"max_abs_err": (got.float() - layer_norm_ref(xs[0] + res[0], w, b, 1e-5).float())
                              .abs().max().item()}
    times = measure(fns, sets)
    floors = {out: m * n * (2 + ob) / bw / 1e3 for out, ob in OUT_BYTES.items()}
    floors["fp16_res"] = m * n * 6 / bw / 1e3
    row = {"m": m, "n": n, "sets": sets, "times": times, "checks": checks, "floor_us": floors}
    t = {k: v.get("kernel_us") for k, v in times.items()}
    print(f"{m}x{n}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items() if v) +
          " | floors " + ", ".join(f"{k} {v:.1f}" for k, v in floors.items()) + f" | {checks}", flush=True)
    return row


def main():
    bw, peak = ceilings()
    print(f"copy {bw:.0f} GB/s, cuBLAS fp16 {peak:.0f} TFLOP/s", flush=True)
    rows = [run(m, n, bw) for m, n in LN_SHAPES]
    path = save("cuda_layernorm", {"copy_gbs": bw, "cublas_tflops": peak, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
