"""End to end on the GPU: saved LLaMA-style decoders (prefill, one token), against torch.compile of the dense model.

    python examples/llama_cuda.py --out artifacts/llama_dynamic                # machine with TVM + nvcc: any length
    python benchmarks/bench_e2e_llama.py artifacts/llama_dynamic --tokens 512 1 4   # GPU: torch + cuda-bindings
    python examples/llama_cuda.py --static --tokens 512 --out artifacts/llama_prefill   # one shape only
    python benchmarks/bench_e2e_llama.py artifacts/llama_prefill

Peers in one process, same token ids: sparta's model as ``sparta.load`` returns it (its calls under torch.compile
with CUDA graphs, the default third stage on CUDA), the same model with its kernels launched from Python
(``inductor=False``), and Hugging Face's ``LlamaModel`` of the same config and dtype (dense) through ``torch.compile``
``default`` and ``reduce-overhead``. Times are the host clock per forward, as a user calls the model (sparta's and the
peers' default-mode calls: the median of 5 windows of calls, so one host stall moves one window). The floor beside
them: the GPU time of the default call's kernels (profiler); the host overhead of a call is what its wall time adds to
that. Also reported: the eager model's forward captured in one CUDA graph (sparta's kernels with the torch ops unfused).
``--tokens``: a model compiled ``dynamic`` is measured at each of these sequence lengths (batch 1), one load serving
all (the default call keeps one CUDA graph per shape); verified at each against the masked dense model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import first_tensor, gpu_busy_us, gpu_kernel_us, gpu_wall_us, save, torch_compile_peers  # noqa: E402

import sparta  # noqa: E402
from sparta.sampling import random_inputs  # noqa: E402

WINDOWS = 5                 # timed windows per measured call; their median is reported


def hf_llama(graph, device):
    """Hugging Face's LlamaModel with the saved graph's shapes and dtype, dense (random weights)."""
    import transformers
    vocab, hidden = graph.tensor("embed_tokens.weight").shape
    layers = 1 + max(int(n.split(".")[1]) for n in graph.tensor_names() if n.startswith("layers."))
    inter = graph.tensor("layers.0.mlp.down_proj.weight").shape[1]     # gate and up may run stacked
    heads = hidden // 128
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                                   use_cache=False)
    return transformers.LlamaModel(cfg).eval().to(graph.tensor("embed_tokens.weight").dtype).to(device)


def measure(path: str, eager, default, worst: dict, tokens: int | None = None,
            modes=("default", "reduce-overhead")) -> dict:
    if tokens is None:
        ids = random_inputs(eager.graph, 3)[0].cuda()
    else:
        vocab = eager.graph.tensor("embed_tokens.weight").shape[0]
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        want = first_tensor(eager(ids)).clone()
        got = first_tensor(default(ids))
        for _ in range(2):
            got = first_tensor(default(ids))
        diff = float((got.float() - want.float()).abs().max())
        dense_ref = first_tensor(eager.reference().to("cuda")(ids))
        vs_reference = float((want.float() - dense_ref.float()).abs().max())
        probe = [m for m in eager.module_replacements().values() if hasattr(m, "wp")][-1]   # the last down_proj
        probe.wp.neg_()      # the comparison is live: one kernel's weights negated must move the output
        sensitivity = float((first_tensor(eager(ids)).float() - want.float()).abs().max())
        probe.wp.neg_()
        floor = gpu_kernel_us(lambda i: eager.module(ids), 1, reps=5, per_graph=3)
        kernels = {}
        busy = gpu_busy_us(lambda: default(ids), by_kernel=kernels)
        rows = {"sparta (sparta.load default: CUDA graphs)": gpu_wall_us(lambda i: default(ids), 1, 100, WINDOWS),
                "sparta, kernels launched from Python": gpu_wall_us(lambda i: eager(ids), 1, 30)}
    hf = hf_llama(eager.graph, "cuda")
    dense = torch_compile_peers({f"hf_llama_{str(hf.dtype)[6:]}": hf}, lambda name, fn: fn(input_ids=ids),
                                modes=modes, windows=WINDOWS)
    best = min(v["wall_us"] for v in dense.values())
    with torch.no_grad():       # the dense model's own GPU time, under the mode that ran fastest
        mode = min(dense, key=lambda k: dense[k]["wall_us"]).split("@")[1]
        torch._dynamo.reset()
        fast = torch.compile(hf, mode=mode)
        dense_busy = gpu_busy_us(lambda: fast(input_ids=ids))
    result = {"tokens": int(ids.numel()), "verify_worst_rel_err": worst, "default_vs_eager_max_diff": diff,
              "eager_vs_dense_reference_max_diff": vs_reference, "diff_with_one_kernel_negated": sensitivity,
              "output_max_abs": float(want.float().abs().max()),
              "eager_in_one_cuda_graph_us": floor, "default_gpu_busy_us": busy, "sparta_us": rows,
              "dense_torch_compile": dense, "speedup_vs_best_dense_compile": {k: best / v for k, v in rows.items()},
              "host_overhead_of_default": rows["sparta (sparta.load default: CUDA graphs)"] / busy - 1,
              "dense_best_gpu_busy_us": dense_busy, "default_gpu_us_by_kernel": kernels}
    print(f"{path}: {ids.numel()} tokens; verified (worst rel. err {max(worst.values()):.2e}; vs the dense reference "
          f"{vs_reference:.3g}, one kernel negated moves it {sensitivity:.3g}, output max {result['output_max_abs']:.3g}); "
          f"GPU time: eager graph in one CUDA graph {floor:.1f} us, the default call's kernels {busy:.1f} us")
    for name, us in rows.items():
        print(f"  {name:>44}: {us:9.1f} us  ({best / us:.2f}x the best dense torch.compile)")
    for name, r in dense.items():
        print(f"  {name:>44}: {r['wall_us']:9.1f} us  (compile {r['compile_s']:.0f} s)")
    print(f"  host overhead of the default call: {result['host_overhead_of_default']:.1%} of its GPU time; GPU time "
          f"alone: sparta {busy:.1f} us, dense {dense_busy:.1f} us ({dense_busy / busy:.2f}x)")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--name", default="e2e_llama")
    ap.add_argument("--tokens", type=int, nargs="*", help="sequence lengths to call a dynamic model at")
    ap.add_argument("--peer-modes", nargs="+", default=["default", "reduce-overhead"],
                    help="torch.compile modes of the dense peer (e.g. max-autotune)")
    args = ap.parse_args()
    payload = {}
    for path in args.paths:
        eager = sparta.load(path, inductor=False).to("cuda")
        default = sparta.load(path).to("cuda")          # CUDA graphs under torch.compile: the default on CUDA
        worst = eager.verify(trials=1)                  # a dynamic model: at three shapes or more
        for tokens in args.tokens or [None]:
            payload[path if tokens is None else f"{path}@{tokens}"] = measure(path, eager, default, worst, tokens,
                                                                                args.peer_modes)
    print(f"wrote {save(args.name, payload)}")


if __name__ == "__main__":
    main()
