"""End to end on the GPU: load a saved CUDA BERT (no TVM), verify it, time it against dense.

    python examples/bert_cuda.py --out artifacts/bert_cuda     # machine with TVM + nvcc, no GPU
    python benchmarks/bench_e2e_bert.py artifacts/bert_cuda    # GPU machine: torch + cuda-bindings

Peers in one process, same inputs: sparta's compiled model (sparse linears in sparta
kernels, the rest torch ops), the same graph run densely with torch ops (cuBLAS linears on
the masked weights: the dense cost of this model), and Hugging Face's ``BertModel`` of the
same config in fp16 (sdpa attention) when transformers is installed; with ``--compile``, each of
them and sparta's model again through ``torch.compile`` (``default`` and ``reduce-overhead``: CUDA
graphs), called as a user calls them. Kernel-only time is one forward captured in a CUDA graph (the
floor without host overhead); the other times are the host clock per forward.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_kernel_us, gpu_wall_us, save, torch_compile_peers  # noqa: E402

import sparta  # noqa: E402
from sparta.sampling import random_inputs  # noqa: E402


def hf_bert(graph, device):
    """Hugging Face's BertModel with the saved graph's depth, fp16, or None without transformers."""
    if importlib.util.find_spec("transformers") is None:
        return None
    import transformers
    layers = 1 + max(int(name.split(".")[2]) for name in graph.tensor_names() if name.startswith("encoder.layer."))
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=layers, attn_implementation="sdpa"))
    return model.eval().half().to(device)


KINDS = (("sparta_bsr", ("bsr",)), ("gemm", ("gemm", "xmma", "cutlass", "cublas")),
         ("attention", ("fmha", "flash", "attention", "attn")), ("layernorm", ("layer_norm",)),
         ("softmax", ("softmax",)))


def breakdown(peers: dict, reps: int = 3) -> dict:
    """GPU time per forward by kernel kind (sparta's kernels, GEMMs, attention, ...), from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for name, fn in peers.items():
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn(0)
            torch.cuda.synchronize()
        kinds, top = {}, []
        for ev in prof.key_averages():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            top.append((ev.device_time_total / reps, ev.count // reps, ev.key[:90]))
            low = ev.key.lower()
            kind = next((k for k, keys in KINDS if any(s in low for s in keys)), "other")
            kinds[kind] = kinds.get(kind, 0.0) + ev.device_time_total / reps
        out[name] = {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
        out[name]["top"] = [[round(us, 1), n, key] for us, n, key in sorted(top, reverse=True)[:12]]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--name", default="e2e_bert")
    ap.add_argument("--compile", action="store_true", help="add torch.compile peers (default, reduce-overhead)")
    args = ap.parse_args()

    tvm_present = importlib.util.find_spec("tvm") is not None
    t0 = time.perf_counter()
    model = sparta.load(args.path, inductor=False)     # the kernels as launched from Python; torch.compile below
    load_s = time.perf_counter() - t0
    model = model.to("cuda")
    t0 = time.perf_counter()
    worst = model.verify(trials=2)
    verify_s = time.perf_counter() - t0
    inputs = [x.cuda() for x in random_inputs(model.graph, 7)]
    dense = model.reference().to("cuda")
    peers = {"sparta": lambda i: model.module(*inputs), "dense_torch": lambda i: dense(*inputs)}
    hf = hf_bert(model.graph, "cuda")
    if hf is not None:
        peers["hf_bert_fp16"] = lambda i: hf(input_ids=inputs[0])
    with torch.no_grad():
        got, ref = model.module(*inputs), dense(*inputs)
    outputs = {name: {"max_abs_diff": float((a.float() - b.float()).abs().max()), "ref_max_abs": float(b.float().abs().max()),
                      "ref_finite": bool(torch.isfinite(b).all()), "mean_abs_diff": float((a.float() - b.float()).abs().mean())}
               for name, a, b in zip(model.graph.outputs, got, ref)}
    # the comparison is live: flipping one kernel's packed weights must change the output
    probe = next(m for m in model.module_replacements().values() if hasattr(m, "wp"))
    with torch.no_grad():
        probe.wp.neg_()
        flipped = model.module(*inputs)
        probe.wp.neg_()
    sensitivity = max(float((a.float() - b.float()).abs().max()) for a, b in zip(flipped, got))
    results = {}
    with torch.no_grad():
        for name, fn in peers.items():
            results[name] = {"kernel_us": gpu_kernel_us(fn, 1, reps=5, per_graph=3), "eager_us": gpu_wall_us(fn, 1, 20)}
    for name, r in results.items():
        r["speedup_vs_dense_kernel"] = results["dense_torch"]["kernel_us"] / r["kernel_us"]
        r["speedup_vs_dense_eager"] = results["dense_torch"]["eager_us"] / r["eager_us"]
    compiled_peers = {}
    if args.compile:
        models = {"sparta": model, "dense_graph": dense, **({"hf_bert_fp16": hf} if hf is not None else {})}
        compiled_peers = torch_compile_peers(
            models, lambda name, fn: fn(input_ids=inputs[0]) if name == "hf_bert_fp16" else fn(*inputs))
    if compiled_peers:
        best_dense = min(v["wall_us"] for k, v in compiled_peers.items() if not k.startswith("sparta"))
        for r in compiled_peers.values():
            r["speedup_vs_best_dense_compile"] = best_dense / r["wall_us"]
    kernels = [k for k in model.kernels if k["template"] != "torch"]
    payload = {"path": args.path, "tvm_importable": tvm_present, "load_s": load_s, "verify_s": verify_s,
               "verify_worst_rel_err": worst, "outputs_vs_dense": outputs,
               "diff_with_one_kernel_negated": sensitivity, "gpu_time_by_kind_us": breakdown(peers), "inputs": [list(x.shape) for x in inputs],
               "sparta_kernels": len(kernels), "torch_fallbacks": len(model.kernels) - len(kernels),
               "blocks": sorted({k["blocks"].split("x", 1)[1] for k in kernels if "x" in k["blocks"]}), "results": results,
               "torch_compile": compiled_peers}
    out = save(args.name, payload)
    print(f"loaded in {load_s:.1f} s (TVM importable: {tvm_present}); verified: worst relative error "
          f"{max(worst.values()):.2e}; {len(kernels)} sparta kernels")
    for name, r in results.items():
        print(f"{name:>14}: kernel {r['kernel_us'] / 1e3:8.2f} ms ({r['speedup_vs_dense_kernel']:.2f}x dense)  "
              f"eager {r['eager_us'] / 1e3:8.2f} ms ({r['speedup_vs_dense_eager']:.2f}x)")
    for name, kinds in payload["gpu_time_by_kind_us"].items():
        top = kinds.pop("top")
        print(f"{name:>14} GPU time by kind (us): {kinds}")
        for row in top:
            print(f"{'':>16}{row[0]:8.1f} us  x{row[1]:<4} {row[2]}")
    for name, r in compiled_peers.items():
        print(f"{name:>24}: {r['wall_us'] / 1e3:8.3f} ms per forward ({r['speedup_vs_best_dense_compile']:.2f}x the best "
              f"dense torch.compile; compile {r['compile_s']:.0f} s, max diff {r['max_abs_diff']:.3g})")
    print(f"one kernel's weights negated: output moves by {sensitivity:.3g} (the comparison is live)")
    print(f"outputs vs dense: {outputs}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
