"""Where a sparse 7B decode step's GPU time goes: one eager decode step of ``bench_generate.py``'s model (no Inductor,
no graph) under torch.profiler, kernels grouped by name.

    python benchmarks/probes/decode_step_profile.py --dir artifacts/gen7b [--dense] --out step.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_generate import checkpoint, meta_path  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--dense", action="store_true", help="profile the dense model instead")
    ap.add_argument("--out")
    args = ap.parse_args()
    import sparta
    from transformers import StaticCache
    meta = json.loads(meta_path(args.dir).read_text())
    dense = checkpoint(meta, "cuda")
    model = dense if args.dense else sparta.load(args.dir, weights=dense).to("cuda").decoder()
    prompt = torch.randint(0, 32000, (1, 512), generator=torch.Generator().manual_seed(3)).cuda()
    cache = StaticCache(config=model.config, max_cache_len=640)
    with torch.no_grad():
        out = model(prompt, past_key_values=cache, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        kw = dict(past_key_values=cache, use_cache=True, position_ids=torch.tensor([[512]], device="cuda"))
        if "cache_position" in model.forward.__code__.co_varnames:
            kw["cache_position"] = torch.tensor([512], device="cuda")
        model(step, **kw)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(step, **kw)
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "device_time_total", 0) > 0:
            rows.append({"name": e.key[:90], "calls": e.count, "us": e.device_time_total})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    print(f"GPU total {total:.0f} us, {sum(r['calls'] for r in rows)} kernels")
    for r in rows[:25]:
        print(f"{r['us']:9.0f} us {r['calls']:5d}  {r['name']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"total_us": total, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
