"""Calibration on the model's device: BERT-base to W8A8 as ``examples/bert_cuda.py --w8a8`` calibrates it, on a GPU and
on the CPU.

    python benchmarks/bench_calibration.py --devices cuda cpu --out calib.json      # a machine with a GPU (no TVM)

Times ``calibrate()`` alone (``QuantConfig.device``): the compile pipeline's capture, simplification and propagation
run first, once; then on each device a copy of the graph is calibrated on 2 random batches of 32 × 128 tokens, a
relative output MSE of 1e-2 per op, int8 weights per channel and per-token int8 activations with static scales where
the CUDA kernels requantise (``widths=(8,)``, ``activations=True``). The devices must reach the same decisions (bits
per tensor) and static scales within 1%.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from bert_cuda import pruned_bert  # noqa: E402
from common import save  # noqa: E402

from sparta.passes import calibrate, propagate  # noqa: E402
from sparta.passes.quant import QuantConfig  # noqa: E402
from sparta.pipeline import PASSES, CompileContext, CompileOptions, run_passes  # noqa: E402


def calibrated(graph, batches, device: str, tolerance: float) -> tuple[float, object]:
    g = graph.copy()
    config = QuantConfig(tolerance, widths=(8,), activations=True, device=device, progress=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = calibrate(g, batches, config, target="cuda")
    return time.perf_counter() - t0, report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", nargs="+", default=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=1e-2)
    ap.add_argument("--out", help="the JSON (default: benchmarks/results/)")
    args = ap.parse_args()
    model, tesa = pruned_bert(args.layers, 32, 0.1)
    ids = torch.randint(0, model.config.vocab_size, (32, 128), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, model.config.vocab_size, ids.shape, generator=gen),) for _ in range(args.batches)]
    options = CompileOptions("cuda", tesa, (ids,))
    upto = [p for p in PASSES if p.name in ("capture", "attach_tesa", "simplify", "fuse_siblings", "plan_tokens",
                                            "target")]
    t0 = time.perf_counter()
    graph = propagate(run_passes(CompileContext(model, options), upto).graph)
    print(f"captured and propagated in {time.perf_counter() - t0:.1f} s", flush=True)
    runs = {}
    for device in args.devices:
        seconds, report = calibrated(graph, batches, device, args.tolerance)
        runs[device] = {"seconds": seconds, "ran_on": report.device, "model_error": report.model_error,
                        "decisions": {d.tensor: d.bits for d in report.decisions},
                        "lowered": len(report.lowered()), "static_scales": report.static_scales}
        print(f"{device}: {seconds:.1f} s (ran on {report.device}), {len(report.lowered())} of "
              f"{len(report.decisions)} tensors lowered, model error {report.model_error:.3g}", flush=True)
    first, *rest = runs.values()
    same = all(r["decisions"] == first["decisions"] and set(r["static_scales"]) == set(first["static_scales"])
               and all(abs(r["static_scales"][k] / first["static_scales"][k] - 1) < 1e-2 for k in r["static_scales"])
               for r in rest)
    payload = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "cpu_threads": torch.get_num_threads(), "layers": args.layers, "batches": args.batches,
               "tokens_per_batch": ids.numel(), "tolerance": args.tolerance, "same_decisions": same, "runs": runs}
    print(json.dumps({k: v for k, v in payload.items() if k != "runs"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=1))
    else:
        print(f"wrote {save('calibration', payload)}")


if __name__ == "__main__":
    main()
