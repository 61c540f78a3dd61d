"""W8A8 BERT-base on the CPU: sparta calibrated to int8 against fp32 eager, end to end.

    python benchmarks/bench_cpu_w8a8.py                  # batch 1 x seq 128, 12 layers
    python benchmarks/bench_cpu_w8a8.py --batch 8

sparta calibrates the model (``activations=True``: int8 weights and per-token int8 activations where the added
output error stays under ``--tolerance``) and runs its dense W8A8 linears on oneDNN's u8·s8 GEMM. Peers in one
process on the same inputs, calls interleaved, medians: the fp32 model in eager torch, ``torch.compile`` of it
(Inductor, default mode), and torch's own dynamic int8 quantisation (``torch.ao.quantization.quantize_dynamic``:
fbgemm, per-tensor 7-bit activations). Accuracy: SQNR of
the last hidden state against the fp32 model's, on an input calibration never saw.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
import transformers
from common import interleaved, save

import sparta


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (got - ref).pow(2).sum()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tolerance", type=float, default=2e-3, help="calibration's added error per op")
    ap.add_argument("--batches", type=int, default=4, help="calibration batches")
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers)).eval()
    shape = (args.batch, args.seq)
    calib = [(torch.randint(0, 30522, shape),) for _ in range(args.batches)]
    ids = torch.randint(0, 30522, shape)
    t0 = time.perf_counter()
    compiled = sparta.compile(model, {}, calib[0], calibration=calib,
                              quant_tolerance={"tolerance": args.tolerance, "activations": True, "progress": False})
    compile_s = time.perf_counter() - t0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    inductor = torch.compile(model)
    with torch.no_grad():
        t0 = time.perf_counter()
        inductor(ids)
        inductor_compile_s = time.perf_counter() - t0
        ref = model(ids).last_hidden_state
        acc = {"sparta": sqnr_db(ref, compiled(ids).last_hidden_state),
               "torch_dynamic": sqnr_db(ref, dynamic(ids).last_hidden_state)}
        ms = interleaved({"fp32": lambda: model(ids), "torch_compile": lambda: inductor(ids),
                          "sparta": lambda: compiled(ids), "torch_dynamic": lambda: dynamic(ids)}, args.reps)
    kinds = {}
    for p in compiled.plan.ops.values():
        if p.gemm is not None:
            key = p.kernel.describe() if p.kernel is not None else "torch (fp32)"
            kinds[key] = kinds.get(key, 0) + 1
    row = {"batch": args.batch, "seq": args.seq, "layers": args.layers, "tolerance": args.tolerance,
           "fp32_ms": ms["fp32"], "torch_compile_ms": ms["torch_compile"], "sparta_ms": ms["sparta"],
           "torch_dynamic_ms": ms["torch_dynamic"], "torch_compile_speedup": ms["torch_compile"] / ms["sparta"],
           "inductor_compile_s": inductor_compile_s,
           "speedup": ms["fp32"] / ms["sparta"], "torch_dynamic_speedup": ms["fp32"] / ms["torch_dynamic"],
           "sqnr_db": acc["sparta"], "torch_dynamic_sqnr_db": acc["torch_dynamic"], "gemm_kernels": kinds,
           "compile_s": compile_s}
    print(compiled.plan_report(only_gemm=True))
    for k in ("fp32", "torch_compile", "sparta", "torch_dynamic"):
        print(f"{k:14s} {ms[k]:8.2f} ms  {ms['fp32'] / ms[k]:.2f}x fp32" +
              (f"  SQNR {acc[k]:.1f} dB" if k in acc else ""))
    print(save(f"cpu_w8a8_b{args.batch}", {"rows": [row]}))


if __name__ == "__main__":
    main()
