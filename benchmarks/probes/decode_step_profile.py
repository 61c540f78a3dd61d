"""Where a sparse 7B decode step's GPU time goes: one decode step of ``bench_generate.py``'s model under
torch.profiler, kernels grouped by name — eager (no Inductor, no graph) or, with ``--inductor``, the step the greedy
loop runs (``torch.compile``'d, launched one kernel at a time, then its CUDA graph timed); ``--phases``: a whole
``generate()`` call timed at three lengths, its fixed cost (prefill, first step, capture) apart from the per-token one;
``--prefill``: the 512-token prefill's kernels; ``--prefill-session``: those of the prefill graph ``generate()``
replays (the ``torch.compile``'d forward into the session's static cache); ``--batch``: prompts and steps of that
many rows.

    python benchmarks/probes/decode_step_profile.py --dir artifacts/gen7b [--dense] [--inductor] [--phases]
        [--prefill-session] [--batch 16] --out s.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_generate import checkpoint, graph_ms, meta_path, session_prefill_ms  # noqa: E402


def kernel_rows(prof) -> list[dict]:
    rows = [{"name": e.key[:110], "calls": e.count, "us": e.device_time_total} for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "device_time_total", 0) > 0]
    return sorted(rows, key=lambda r: -r["us"])


def show(title: str, rows: list[dict], top: int = 30) -> dict:
    total = sum(r["us"] for r in rows)
    print(f"{title}: GPU total {total:.0f} us, {sum(r['calls'] for r in rows)} kernels")
    for r in rows[:top]:
        print(f"{r['us']:9.0f} us {r['calls']:5d}  {r['name']}")
    return {"total_us": total, "kernels": rows}


def profiled(fn) -> list[dict]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return kernel_rows(prof)


def phases(model, generate, prompt) -> dict:
    """Wall time of whole generate() calls at three lengths: the slope is a token's cost, the rest the call's."""
    out = {}
    for new in (3, 34, 130):
        generate(prompt, new)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            generate(prompt, new)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[new] = sorted(times)[1] * 1e3
    per_token = (out[130] - out[34]) / 96
    fixed = out[130] - 130 * per_token
    print(f"generate ms by new tokens {out}; per token {per_token:.3f} ms, fixed {fixed:.1f} ms")
    return {"ms_by_new_tokens": out, "per_token_ms": per_token, "fixed_ms": fixed}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--dense", action="store_true", help="profile the dense model instead")
    ap.add_argument("--inductor", action="store_true", help="also the torch.compile'd step and its CUDA graph")
    ap.add_argument("--phases", action="store_true", help="also time whole generate() calls")
    ap.add_argument("--prefill", action="store_true", help="also the 512-token prefill (eager, kernels by name)")
    ap.add_argument("--prefill-session", action="store_true",
                    help="also the prefill graph generate() replays (compiled forward, session's cache)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    import sparta
    from transformers import StaticCache
    meta = json.loads(meta_path(args.dir).read_text())
    dense = checkpoint(meta, "cuda")
    model = dense if args.dense else sparta.load(args.dir, weights=dense).to("cuda").decoder()
    model.generation_config.eos_token_id = None
    b = args.batch
    prompt = torch.randint(0, 32000, (b, 512), generator=torch.Generator().manual_seed(3)).cuda()
    cache = StaticCache(config=model.config, max_cache_len=640)
    result = {"dense": args.dense, "batch": b, "device": torch.cuda.get_device_name()}
    try:
        run(args, model, prompt, cache, result)
    finally:                                     # what was measured is kept when a later part fails
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))


def run(args, model, prompt, cache, result) -> None:
    from sparta.runtime.decode_loop import compiled_step, greedy_generate
    b = prompt.shape[0]
    with torch.no_grad():
        out = model(prompt, past_key_values=cache, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        kw = dict(past_key_values=cache, use_cache=True, position_ids=torch.full((b, 1), 512, device="cuda"))
        if "cache_position" in model.forward.__code__.co_varnames:
            kw["cache_position"] = torch.tensor([512], device="cuda")
        result["eager"] = show("eager step", profiled(lambda: model(step, **kw)))
        if args.inductor:
            forward = compiled_step(model)
            result["inductor"] = show("torch.compile'd step", profiled(lambda: forward(step, **kw)))
            result["inductor_graph_us"] = graph_ms(lambda s: forward(s, **kw), step, reps=50) * 1e3
            result["eager_graph_us"] = graph_ms(lambda s: model(s, **kw), step, reps=50) * 1e3
            print(f"step as one CUDA graph: compiled {result['inductor_graph_us']:.0f} us, "
                  f"eager {result['eager_graph_us']:.0f} us")
        if args.prefill:
            result["prefill"] = show("prefill of 512 tokens", profiled(lambda: model(prompt, use_cache=False)))
        if args.prefill_session:
            from sparta.runtime.decode_session import session_for
            session = session_for(model, b, 640, torch.device("cuda"), graphs=True)
            session.prefill(prompt, None, inductor=True)
            result["prefill_session"] = show("prefill session graph", profiled(lambda: session.prefill(prompt, None)))
            result["prefill_session_ms"] = session_prefill_ms(model, prompt, reps=20)
            print(f"prefill session graph {result['prefill_session_ms']:.2f} ms")
        if args.phases:
            def generate(p, n):
                return greedy_generate(model, p, max_new_tokens=n, pad_token_id=0)
            result["phases"] = phases(model, generate, prompt)


if __name__ == "__main__":
    main()
