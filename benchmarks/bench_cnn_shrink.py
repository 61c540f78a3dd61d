"""CNN channel shrinking: ResNet-18, ResNet-50 and MobileNetV2 with half of each block's inner convolutions' output
channels pruned.

Torchvision's models (random weights, seeded; BatchNorm statistics drawn so pruned channels leave nonzero constants),
50% of the output channels of each residual block's convolutions but its last (each inverted residual's expansion)
pruned by L2 norm (``torch.nn.utils.prune.ln_structured``), fp16, channels_last, batch 1 and 32 (the same models
from ``torch.nn`` where torchvision does not import: ``cnn_nn_models.py``). Peers in one process: the dense (masked)
model eager and under ``torch.compile``, the best of its default and ``reduce-overhead`` modes;
sparta's default compile (``target="cuda"``: BatchNorms folded, the pruned channels shrunk, Inductor and a CUDA graph
around the torch ops); Torch-Pruning's physically shrunk model under ``torch.compile`` (the same best of two
modes) where ``torch_pruning`` is importable (it drops the pruned channels' BatchNorm constants, so its output
differs). Prints a JSON with µs per call and ratios against the dense peer::

    python benchmarks/bench_cnn_shrink.py --out cnn_shrink.json                 # GPU: compile here, measure
    python benchmarks/bench_cnn_shrink.py --build artifacts/cnn                 # compile and save (no GPU needed)
    python benchmarks/bench_cnn_shrink.py --dir artifacts/cnn --out cnn.json    # GPU: load the saved models
    python benchmarks/bench_cnn_shrink.py --device cpu --smoke                  # a tiny torch.nn network, on the CPU

The shrunk convolutions run as torch ops, so compiling needs no TVM (a CNN whose plan holds no sparse GEMM), and a
saved model loads without it (``sparta.load``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import prune

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sparta  # noqa: E402
from cnn_nn_models import NN_MODELS  # noqa: E402


class _Block(nn.Module):
    """The smoke network's residual block (BasicBlock-shaped)."""

    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def smoke_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), _Block(16), _Block(16),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def build_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if name == "smoke":
        model = smoke_model()
    else:
        try:
            import torchvision
            model = getattr(torchvision.models, name)(weights=None)
        except ImportError:
            if name not in NN_MODELS:
                raise
            model = NN_MODELS[name]()              # the CPU machine has no torchvision
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return model.eval()


def inner_convs(model: nn.Module) -> list[nn.Conv2d]:
    """Each residual block's convolutions but its last; each inverted residual's 1×1 expansion."""
    out = []
    for m in model.modules():
        kind = type(m).__name__
        if kind in ("BasicBlock", "Bottleneck", "_Block"):
            convs = [c for name, c in m.named_children() if isinstance(c, nn.Conv2d) and name.startswith("conv")]
            out += convs[:-1]
        elif kind == "InvertedResidual":
            convs = [c for c in m.modules() if isinstance(c, nn.Conv2d)]
            if len(convs) == 3:                              # expansion, depthwise, projection
                out.append(convs[0])
    return out


def prune_model(model: nn.Module, amount: float) -> dict[nn.Conv2d, list[int]]:
    """``amount`` of each inner convolution's output channels pruned by L2 norm; the pruned indices per conv."""
    pruned = {}
    for conv in inner_convs(model):
        prune.ln_structured(conv, "weight", amount=amount, n=2, dim=0)
        pruned[conv] = (~conv.weight_mask.flatten(1).any(1)).nonzero().flatten().tolist()
    return pruned


def masked(model: nn.Module, name: str, seed: int) -> nn.Module:
    """A fresh copy of a pruned model with its masks applied to plain weights (what the dense peers run)."""
    state = {k.replace("weight_orig", "weight"): v for k, v in model.state_dict().items() if not k.endswith("_mask")}
    for path, m in model.named_modules():
        if hasattr(m, "weight_mask"):
            state[f"{path}.weight"] = m.weight_orig.detach() * m.weight_mask
    clean = build_model(name, seed)
    clean.load_state_dict({k: v.float() for k, v in state.items()})
    return clean.eval()


def torch_pruned(model: nn.Module, name: str, seed: int, pruned: dict, x: torch.Tensor) -> nn.Module | None:
    """Torch-Pruning's shrunk copy of the pruned model (the pruned channels and their BatchNorm entries removed), or
    None without ``torch_pruning``."""
    try:
        import torch_pruning as tp
    except ImportError:
        return None
    clean = masked(model, name, seed)
    convs = dict(clean.named_modules())
    names = {id(m): n for n, m in model.named_modules()}
    dg = tp.DependencyGraph().build_dependency(clean, example_inputs=x)
    for conv, idxs in pruned.items():
        group = dg.get_pruning_group(convs[names[id(conv)]], tp.prune_conv_out_channels, idxs=idxs)
        if dg.check_pruning_group(group):
            group.prune()
    return clean.eval()


def wall_us(fn, x, device: str, iters: int, windows: int = 3) -> float:
    """Median over ``windows`` of the µs per call of ``iters`` back-to-back calls, synchronised at the end."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        sync()
        means = []
        for _ in range(windows):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(x)
            sync()
            means.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(means)


def compile_sparta(model: nn.Module, size: int, dtype, target: str, batches: list[int]):
    """Sparta's default compile at an example of batch 2, planned over every batch up to the largest measured."""
    x = torch.randn(2, 3, size, size, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sparta.compile(model, None, (x,), target=target, tokens=(1, max(2, *batches)))


def compiled_modes_us(model: nn.Module, x: torch.Tensor, args) -> dict[str, float]:
    """µs per call of ``torch.compile(model)`` in each mode (``default`` and, on CUDA, ``reduce-overhead``; the model
    itself with ``--no-compile``)."""
    modes = {}
    for mode in ("default", "reduce-overhead") if args.device == "cuda" else ("default",):
        torch._dynamo.reset()
        fn = torch.compile(model, mode=mode) if not args.no_compile else model
        modes[mode] = wall_us(fn, x, args.device, args.iters)
    return modes


def measure(name: str, args, compiled=None) -> dict:
    device, dtype = args.device, torch.float16 if args.device == "cuda" else torch.float32
    model = build_model(name, args.seed)
    pruned = prune_model(model, args.amount)
    size = 32 if name == "smoke" else 224
    t0 = time.perf_counter()
    if compiled is None:                  # the batch is free: one compile serves every batch (planned up to the largest)
        compiled = compile_sparta(model.to(dtype), size, dtype, args.device, args.batch)
    compile_s = time.perf_counter() - t0
    shrunk = [p.op for p in compiled.plan.ops.values() if p.kind == "shrink"]
    dense = masked(model, name, args.seed).to(dtype).to(device).to(memory_format=torch.channels_last)
    sparta_model = compiled.to(device)
    result = {"compile_s": round(compile_s, 2), "shrunk_ops": len(shrunk),
              "plan_est_us": round(compiled.plan.est_us(), 1), "plan_dense_us": round(compiled.plan.dense_us(), 1),
              "batches": {}}
    with torch.enable_grad():                 # Torch-Pruning traces through autograd
        tp_model = torch_pruned(model, name, args.seed, pruned, torch.randn(1, 3, size, size))
    if tp_model is not None:
        tp_model = tp_model.to(dtype).to(device).to(memory_format=torch.channels_last)
    for batch in args.batch:
        x = torch.randn(batch, 3, size, size, dtype=dtype, device=device).to(memory_format=torch.channels_last)
        row = {}
        with torch.no_grad():
            want = dense(x).float()
            row["dense_eager_us"] = wall_us(dense, x, device, args.iters)
            modes = compiled_modes_us(dense, x, args)
            row["dense_compile_us"] = min(modes.values())
            row["dense_compile_modes_us"] = modes
            got = sparta_model(x).float()
            row["sparta_us"] = wall_us(sparta_model, x, device, args.iters)
            row["sparta_max_abs_diff"] = float((got - want).abs().max())
            if tp_model is not None:              # the same best of the two modes
                tp_modes = compiled_modes_us(tp_model, x, args)
                row["torch_pruning_us"] = min(tp_modes.values())
                row["torch_pruning_modes_us"] = tp_modes
                row["torch_pruning_max_abs_diff"] = float((tp_model(x).float() - want).abs().max())
        row["sparta_vs_dense_compile"] = round(row["dense_compile_us"] / row["sparta_us"], 3)
        row["sparta_vs_dense_eager"] = round(row["dense_eager_us"] / row["sparta_us"], 3)
        if "torch_pruning_us" in row:
            row["sparta_vs_torch_pruning"] = round(row["torch_pruning_us"] / row["sparta_us"], 3)
        result["batches"][str(batch)] = row
    return result


def build(args) -> None:
    root = Path(args.build)
    for name in args.models:
        model = build_model(name, args.seed)
        prune_model(model, args.amount)
        size = 32 if name == "smoke" else 224
        dtype = torch.float16 if args.device == "cuda" else torch.float32
        compile_sparta(model.to(dtype), size, dtype, args.device, args.batch).save(root / name)
    (root / "meta.json").write_text(json.dumps({"seed": args.seed, "amount": args.amount, "models": args.models}))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["resnet50", "mobilenet_v2"])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--amount", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="a tiny torch.nn network (no torchvision)")
    ap.add_argument("--no-compile", action="store_true", help="peers without torch.compile (quick checks)")
    ap.add_argument("--build", help="compile for --device and save each model here (CUDA: no GPU needed)")
    ap.add_argument("--dir", help="the folder --build wrote: load the models from it")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.iters = ["smoke"], min(args.iters, 5)
    if args.build:
        build(args)
        return {}
    if args.dir:
        meta = json.loads((Path(args.dir) / "meta.json").read_text())
        args.seed, args.amount = meta["seed"], meta["amount"]
    results = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "amount": args.amount, "models": {}}
    for name in args.models:
        loaded = sparta.load(Path(args.dir) / name) if args.dir else None
        results["models"][name] = measure(name, args, loaded)
        if args.out:                          # as each model comes
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
