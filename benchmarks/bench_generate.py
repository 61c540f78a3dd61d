"""``generate()`` end to end: a Hugging Face Llama-shaped decoder, block-sparse, compiled here, run on a GPU with its
weights from a checkpoint built there, against dense ``generate()`` peers in one process.

    # machine with TVM + nvcc: compile, save the plan and kernels only (no weights)
    python benchmarks/bench_generate.py --build artifacts/gen7b --layers 32 --density 0.1
    # GPU: build the checkpoint from the config and seed, load with it, generate, measure
    python benchmarks/bench_generate.py --dir artifacts/gen7b --prompt 512 --new 128 --batch 1 --out gen.json
    # every linear 4-bit (W4A16), compiled from the meta device: no checkpoint here
    python benchmarks/bench_generate.py --build artifacts/gen7b-w4 --layers 32 --meta --bits 4 --density 1

The model is Llama-2-7B's shape (width 4096, FFN 11008, 32 heads, vocabulary 32000; ``--layers`` of its 32 layers),
bf16, random weights from ``--seed``; every decoder linear keeps ``--density`` of its ``--block`` blocks, chosen by a
seeded generator that gives the same masks on every machine (``--pattern 2:4``: 2 of every 4 along K instead;
``--bits 4``: and its weights are 4-bit, W4A16; ``--bits 8``: 8-bit beside bf16 activations, which the plan runs as
FP8 (E4M3) weights where that is cheaper; with ``--meta`` the scales are fitted at load to the checkpoint built on the
GPU, there; ``--formats fp8_e4m3``: FP8 wherever it can run).
Peers, each on the same masked weights: sparta's default greedy call (its loop: one CUDA graph per token,
``sparta.runtime.decode_loop``) and the same through Hugging Face's loop (graphs per step); the dense model in
sparta's loop (gpt-fast's: the fairest dense peer), in Hugging Face's loop with graphs per step, with its static cache
and its own ``torch.compile`` of the step (``reduce-overhead``), and eager. Reported: tokens/s of the new tokens
(prefill included in the wall time, as a user sees it), the bytes floor (weights read per step at 3.0 TB/s), next-token
KL divergence to the fp32 masked model on the prompt for sparta and for the dense bf16 model, and prefill as Hugging
Face runs it (eager) and as one CUDA graph (the GPU's time alone).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_mask, save  # noqa: E402

LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                 vocab_size=32000, max_position_embeddings=4096)


def config(layers: int):
    import transformers
    return transformers.LlamaConfig(num_hidden_layers=layers, **LLAMA2_7B)


def grids_for(model, density: float, block: int) -> dict[str, torch.Tensor]:
    """Seeded block grids (kept blocks true) of every decoder linear, the same on every machine."""
    return {name: bench_mask(p.shape[0] // block, p.shape[1] // block, density, f"gen-{name}")
            for name, p in model.named_parameters() if name.endswith("proj.weight")}


def nm_masks(model) -> dict[str, torch.Tensor]:
    """Seeded 2:4 masks (2 kept of every 4 along K, at random) of every decoder linear, the same on every machine."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("proj.weight"):
            g = torch.Generator().manual_seed(zlib.crc32(f"gen-nm-{name}".encode()))
            scores = torch.rand(p.shape[0], p.shape[1] // 4, 4, generator=g)
            keep = torch.zeros(scores.shape, dtype=torch.bool).scatter_(-1, scores.topk(2, dim=-1).indices, True)
            out[name] = keep.reshape(p.shape[0], p.shape[1])
    return out


def expand(grid: torch.Tensor, block: int) -> torch.Tensor:
    return grid.repeat_interleave(block, 0).repeat_interleave(block, 1)


def build(args) -> None:
    import sparta
    import transformers
    cfg = config(args.layers)
    with torch.device("meta"):
        shapes = transformers.LlamaForCausalLM(cfg)
    if args.pattern == "2:4":
        masks = {n: sparta.TeSA.from_mask(m, args.bits) for n, m in nm_masks(shapes).items()}
    else:
        grids = grids_for(shapes, args.density, args.block)
        masks = {n: sparta.TeSA.dense(tuple(shapes.get_parameter(n).shape), args.bits) if args.density >= 1 else
                 sparta.TeSA.from_blocks(g, (args.block, args.block), args.bits) for n, g in grids.items()}
    del shapes
    torch.manual_seed(args.seed)
    model = bf16_model(cfg, "meta" if args.meta else "cpu")     # meta: no checkpoint at compile time
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    compiled = sparta.compile(model, masks, (ids,), target="cuda", tokens=(1, args.prompt_tokens),
                              formats=args.formats)
    compile_s = time.perf_counter() - t0
    print(f"compiled in {compile_s:.0f} s, peak RSS {peak_rss_gib():.1f} GiB", flush=True)
    compiled.save(args.build, weights=False)
    print(f"saved, peak RSS {peak_rss_gib():.1f} GiB", flush=True)
    meta = {"layers": args.layers, "density": 0.5 if args.pattern == "2:4" else args.density, "block": args.block,
            "pattern": args.pattern, "seed": args.seed, "bits": args.bits, "formats": args.formats,
            "compile_s": compile_s, "timings": compiled.timings, "meta_device": args.meta,
            "peak_rss_gib": peak_rss_gib()}
    meta_path(args.build).write_text(json.dumps(meta, indent=1))
    print(compiled.plan_report(only_gemm=True))
    print(json.dumps(meta, indent=1))


def peak_rss_gib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def bf16_model(cfg, device: str):
    """The model created in bf16 on ``device`` (a 7B model created in fp32 first would need 27 GB)."""
    import transformers
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def meta_path(folder) -> Path:
    """What the benchmark needs of a build (layers, masks' seed, compile time): beside the saved folder, whose every
    file the manifest lists."""
    return Path(str(folder).rstrip("/") + ".bench.json")


def checkpoint(meta: dict, device: str):
    """The dense model of the folder's config and seed, bf16 on ``device``, its pruned blocks zero."""
    torch.manual_seed(meta["seed"])
    model = bf16_model(config(meta["layers"]), device)
    with torch.no_grad():
        if meta.get("pattern") == "2:4":
            for name, mask in nm_masks(model).items():
                model.get_parameter(name).mul_(mask.to(device))
        for name, grid in grids_for(model, meta["density"], meta["block"]).items() \
                if meta["density"] < 1 and meta.get("pattern", "blocks") == "blocks" else ():
            model.get_parameter(name).mul_(expand(grid, meta["block"]).to(device))
    return model


def timed_generate(fn, prompt, new: int, reps: int) -> dict:
    out = fn(prompt, new)                 # first call: captures, compiles, allocates
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(prompt, new)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = sorted(times)[len(times) // 2]
    return {"s": best, "tok_s": prompt.shape[0] * new / best, "tokens": out[0, prompt.shape[1]:].tolist()}


def prefill_ms(forward, prompt, reps: int = 10) -> float:
    with torch.no_grad():
        forward(prompt)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            forward(prompt)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def graph_ms(forward, prompt, reps: int = 10) -> float:
    """GPU time of one forward captured in a CUDA graph (no host cost): what a prefill captured per length costs."""
    with torch.no_grad():
        forward(prompt)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward(prompt)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def session_prefill_ms(model, prompt, reps: int = 10) -> float:
    """A prefill as the greedy loop runs it (its session's CUDA graph for the prompt's bucket, the cache reset
    before): wall time over ``reps`` back-to-back calls."""
    session = model.sparta_decode_sessions[prompt.shape[0]]
    with torch.no_grad():
        session.prefill(prompt, None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            session.prefill(prompt, None)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def kl_to(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || model) of the next-token distributions."""
    p = torch.log_softmax(reference_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def run(args) -> dict:
    import sparta
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from sparta.runtime.decode_graphs import DecodeGraphs
    from sparta.runtime.decode_loop import greedy_generate
    meta = json.loads(meta_path(args.dir).read_text())
    dense = checkpoint(meta, "cuda")
    compiled = sparta.load(args.dir, weights=dense).to("cuda")
    vocab = dense.config.vocab_size
    prompt = torch.randint(0, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(3)).cuda()
    kw = dict(do_sample=False, pad_token_id=0)
    decoder = compiled.decoder()
    for m in (dense, decoder):                  # every peer generates all n tokens (no end of sequence)
        m.generation_config.eos_token_id = None
    results = {"meta": meta, "batch": args.batch, "prompt": args.prompt, "new": args.new,
               "device": torch.cuda.get_device_name()}

    def sparta_gen(p, n):                       # the default call: greedy, one CUDA graph per token
        return compiled.generate(p, max_new_tokens=n, **kw)

    def sparta_hf_loop(p, n):                   # Hugging Face's loop (min_new_tokens takes it), graphs per step
        return compiled.generate(p, max_new_tokens=n, min_new_tokens=n, **kw)

    def dense_fast(p, n):                       # the dense model in sparta's loop: gpt-fast's
        return greedy_generate(dense, p, max_new_tokens=n, pad_token_id=0)

    def eager_gen(p, n):
        return dense.generate(p, max_new_tokens=n, disable_compile=True, **kw)

    graphs = DecodeGraphs(dense)

    def graphs_gen(p, n):
        dense.get_compiled_call = lambda *_: graphs
        try:
            return dense.generate(p, max_new_tokens=n, cache_implementation="static", **kw)
        finally:
            del dense.get_compiled_call

    def hf_compiled_gen(p, n):
        return dense.generate(p, max_new_tokens=n, cache_implementation="static", **kw)

    peers = {"sparta": sparta_gen, "dense_fast_loop": dense_fast, "sparta_hf_loop": sparta_hf_loop,
             "dense_hf_loop_graphs": graphs_gen, "dense_eager": eager_gen,
             "dense_hf_compile": hf_compiled_gen}      # the slowest to start last
    results["prefill_ms"] = {"sparta": prefill_ms(lambda x: decoder(x, use_cache=False), prompt),
                             "dense_eager": prefill_ms(lambda x: dense(x, use_cache=False), prompt)}
    results["prefill_graph_ms"] = {"sparta": graph_ms(lambda x: decoder(x, use_cache=False), prompt),
                                   "dense": graph_ms(lambda x: dense(x, use_cache=False), prompt)}
    print("prefill", results["prefill_ms"], results["prefill_graph_ms"], flush=True)
    with torch.no_grad():
        sparse_logits = decoder(prompt[:1], use_cache=False).logits
        dense_logits = dense(prompt[:1], use_cache=False).logits
        fp32 = copy.deepcopy(dense).float()
        ref = fp32(prompt[:1], use_cache=False).logits
        del fp32
    results["kl_to_fp32_masked"] = {"sparta": kl_to(ref, sparse_logits), "dense_bf16": kl_to(ref, dense_logits)}
    print("kl", results["kl_to_fp32_masked"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    for name, fn in peers.items():
        if args.only and name not in args.only:
            continue
        try:
            with torch.no_grad():
                results[name] = timed_generate(fn, prompt, args.new, args.reps)
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, the others still run
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, {k: v for k, v in results[name].items() if k != "tokens"}, flush=True)
        if args.out:                           # what is measured survives a run cut off later
            Path(args.out).write_text(json.dumps(results, indent=1))
    results["prefill_session_ms"] = {name: session_prefill_ms(m, prompt) for name, m in
                                     (("sparta", decoder), ("dense", dense)) if prompt.shape[0] in
                                     m.__dict__.get("sparta_decode_sessions", {})}
    print("prefill as the greedy loop runs it", results["prefill_session_ms"], flush=True)
    held = {id(b): b for m in compiled.module_replacements().values() if isinstance(m, torch.nn.Module)
            for b in m.buffers() if b is not None and b.is_cuda}           # shared buffers counted once
    results["sparta_linears_gb"] = sum(b.numel() * b.element_size() for b in held.values()) / 1e9
    print("sparta's kernel modules hold", round(results["sparta_linears_gb"], 3), "GB after the runs", flush=True)
    ok = [k for k in peers if "tok_s" in results.get(k, {}) and k.startswith("dense")]
    if "tok_s" in results.get("sparta", {}) and ok:
        best = max(ok, key=lambda k: results[k]["tok_s"])
        results["speedup_vs_best_dense"] = {"peer": best, "x": results["sparta"]["tok_s"] / results[best]["tok_s"]}
        results["same_tokens_as_dense"] = results["sparta"]["tokens"] == results[best]["tokens"]
    kept = sum(g.sum().item() * meta["block"] ** 2 if meta["density"] < 1 else g.numel() * meta["block"] ** 2
               for g in grids_for(dense, meta["density"], meta["block"]).values())
    bits = meta.get("bits", 16)          # 4 bits: + an fp16 scale per 128; 8 (E4M3): + an fp32 scale per channel
    per_kept = 2 if bits >= 16 else 1 + 4 / 4096 if bits == 8 else bits / 8 + 2 / 128
    if meta.get("pattern") == "2:4":                                             # + a 2-bit index per kept value
        per_kept = 2.25
    step = 2 * sum(p.numel() for n, p in dense.named_parameters() if not n.endswith("proj.weight")) + per_kept * kept
    results["bytes_floor_tok_s"] = {"bytes_per_step": step, "at_3.0TBps": args.batch * 3.0e12 / step}
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", help="compile and save the kernels-only folder here (machine with TVM)")
    ap.add_argument("--dir", help="the folder --build wrote (GPU machine)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--pattern", choices=("blocks", "2:4"), default="blocks",
                    help="--build: blocks of --block kept at --density, or 2 of every 4 along K (2:4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bits", type=int, default=16,
                    help="--build: the decoder linears' weight bits (4: W4A16; 8: FP8 weights where cheaper)")
    ap.add_argument("--formats", help="--build: compile(formats=...), e.g. fp8_e4m3: FP8 weights wherever they can")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="--build: the largest prefill planned for")
    ap.add_argument("--meta", action="store_true", help="--build: compile the model created on the meta device")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="peers to run (default: all)")
    ap.add_argument("--out", help="write the JSON here (default: benchmarks/results/)")
    ap.add_argument("--inductor-config", nargs="*", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config settings for every peer's compile, e.g. combo_kernels=1")
    args = ap.parse_args()
    if args.build:
        return build(args)
    import torch._inductor.config as inductor_config
    for item in args.inductor_config:
        key, _, value = item.partition("=")
        setattr(inductor_config, key, type(getattr(inductor_config, key))(int(value) if value.isdigit() else value))
    results = run(args)
    results["inductor_config"] = args.inductor_config
    text = json.dumps({k: v for k, v in results.items()}, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        print(save("generate", results))
    print(json.dumps({k: v for k, v in results.items() if k not in ("sparta", "dense_eager", "dense_cuda_graphs",
                                                                    "dense_hf_compile")}, indent=1))


if __name__ == "__main__":
    main()
