"""ResNet-50's 3x3 convolutions: sparta's block-sparse implicit-GEMM kernel against cuDNN, in one process.

    python benchmarks/bench_cuda_conv2d.py --build [DIR]             # here (TVM + nvcc); DIR: artifacts/cuda_conv2d/
    python benchmarks/bench_cuda_conv2d.py [--dir DIR] [--out FILE]  # on the GPU machine (torch + cuda-bindings)

The 3x3, stride-1, padding-1 convolutions of ResNet-50's stages (64 channels at 56x56, 128 at 28x28, 256 at 14x14,
512 at 7x7), fp16 channels-last, bias + ReLU, batches of 1 and 32; weights dense and with 50%, 75% and 90% of their
(64 output channels x (tap, 32 input channels)) blocks pruned (seeded masks). Peers: ``cudnn`` (``F.conv2d`` on
channels-last fp16 with the bias, then ``F.relu``: what torch runs for the masked model) and ``cudnn_conv`` (the
convolution alone). ``sparta`` is the faster of two tilings (``t128``: 128 pixels x 64 channels per CTA, 4 warps;
``t64``: 64 x 64, 4 warps, K blocks of 64 channels where the channels allow), each checked against cuDNN on the
masked weight first, then timed kernel-only: CUDA graphs of 40 calls rotating input sets beyond the L2.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from common import build_or_time, bench_mask, gpu_kernel_us, save  # noqa: E402  (benchmarks/ is the script's folder)

OUT = Path(os.environ.get("SPARTA_CUDA_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "cuda")
           ).parent / "cuda_conv2d"
STAGES = ((64, 56), (128, 28), (256, 14), (512, 7))        # (channels, spatial size) of each 3x3 convolution
TILES = {"t128": dict(bn=64, bk=32, tm=128, warps_m=4, warps_n=1, stages=3),
         "t64": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=3)}
DENSITIES = (1.0, 0.5, 0.25, 0.1)
BATCHES = (1, 32)
L2_BEATING_BYTES = 256 << 20


def spec_of(c: int, hw: int, tile: str):
    from sparta.templates.conv2d.spec import Conv2dSpec
    return Conv2dSpec(c, c, hw, hw, 3, 3, padding=1, act="relu", name=f"cv_r50_{c}x{hw}_{tile}", **TILES[tile])


def build(folder: Path, jobs: int) -> None:
    from sparta.codegen.cuda_build import build_folders
    specs = {spec.name: spec for c, hw in STAGES for tile in TILES for spec in [spec_of(c, hw, tile)]}
    build_folders(specs, folder, jobs, log=lambda line: print(line, flush=True))


def bench(c: int, hw: int, b: int, density: float, root: Path) -> dict:
    from sparta.templates.conv2d.runtime import Conv2dCUDA, folder_spec
    from sparta.templates.conv2d.spec import expand_block_mask
    specs = {t: folder_spec(root / f"cv_r50_{c}x{hw}_{t}") for t in TILES}
    g = torch.Generator().manual_seed(c * 131 + hw)
    w = torch.randn(c, c, 3, 3, generator=g) / (9 * c) ** 0.5
    bias = (torch.randn(c, generator=g) * 0.1).half().cuda()
    tag = f"conv2d_{c}x{hw}_{density}"
    masks, mods = {}, {}
    for t, spec in specs.items():
        blocks = bench_mask(spec.row_blocks, spec.k_blocks, density, tag) if density < 1 else \
            torch.ones(spec.row_blocks, spec.k_blocks, dtype=torch.bool)
        masks[t] = blocks
        wm = (w * expand_block_mask(blocks, spec)).half()
        mods[t] = (Conv2dCUDA.from_weight(spec.name, root / spec.name, spec, wm, bias.cpu()).cuda(), wm.cuda())
    x_bytes = b * c * hw * hw * 2
    sets = max(2, min(16, math.ceil(L2_BEATING_BYTES / x_bytes)))
    xs = [torch.randn(b, c, hw, hw, device="cuda").half().to(memory_format=torch.channels_last) for _ in range(sets)]
    err = {}
    for t, (m, wm) in mods.items():
        want = F.relu(F.conv2d(xs[0], wm, bias, padding=1)).float()
        err[t] = (m(xs[0]).float() - want).abs().max().item()
        if not err[t] < 0.05:
            raise SystemExit(f"sparta {t} is wrong at C={c} {hw}x{hw} B={b} density {density}: max |err| {err[t]}")
    w_cudnn = mods["t128"][1]          # cuDNN's time does not depend on which zeros the weight holds
    fns = {f"sparta_{t}": (lambda i, m=m: m(xs[i])) for t, (m, _) in mods.items()}
    fns["cudnn"] = lambda i: F.relu(F.conv2d(xs[i], w_cudnn, bias, padding=1))
    fns["cudnn_conv"] = lambda i: F.conv2d(xs[i], w_cudnn, None, padding=1)
    us = {k: gpu_kernel_us(fn, sets) for k, fn in fns.items()}
    best = min(TILES, key=lambda t: us[f"sparta_{t}"])
    us["sparta"] = us[f"sparta_{best}"]
    flops = 2 * b * hw * hw * c * c * 9
    return {"channels": c, "size": hw, "batch": b, "density": density,
            "kept_blocks": {t: int(m.sum()) for t, m in masks.items()}, "input_sets": sets, "best_tile": best,
            "us": {k: round(v, 2) for k, v in us.items()}, "max_abs_err": err,
            "sparta_dense_TFLOPs": flops / us["sparta"] / 1e6, "cudnn_over_sparta": us["cudnn"] / us["sparta"],
            "cudnn_conv_over_sparta": us["cudnn_conv"] / us["sparta"]}


def main():
    args = build_or_time(__doc__, OUT, build)
    if args is None:
        return
    torch.backends.cudnn.benchmark = True
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
          flush=True)
    rows = []
    for c, hw in STAGES:
        for b in BATCHES:
            for density in DENSITIES:
                rows.append(bench(c, hw, b, density, Path(args.dir)))
                r = rows[-1]
                print(f"C={c:3d} {hw:2d}x{hw:<2d} B={b:2d} density {density:.2f}: " +
                      " ".join(f"{k} {t:.1f}" for k, t in r["us"].items()) +
                      f" µs; {r['cudnn_over_sparta']:.2f}x cudnn ({r['best_tile']})", flush=True)
    payload = {"device": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(), "rows": rows}
    print(f"wrote {save('conv2d', payload)}")
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
