"""Reproduce the SparTA paper's bit-propagation demo: calibration finds the fewest bits each layer keeps.

Two models, random init (seeded, no download): a MobileNet-style CNN built here and BERT-base
from its config. Each is calibrated on 4 batches of random inputs against the CPU target's
widths (weights: int4 at fp32 activations; activations: int8, which selects W8A8 kernels), with
a per-op tolerance on the relative output MSE each op may add. The tables list the layers whose
bits dropped and the final model's output error against the fp32 model (relative MSE), measured
once by calibration's own walk and once independently (the torch model with the calibrated
weights swapped in, weights-only runs). Run:

    python examples/quantize_calibration.py        # writes examples/results/quantization.md + plots
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
import torch.nn as nn
import transformers

import sparta
from sparta.passes import calibrate
from sparta.passes.quant import fake_quantized_weights


def separable(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    """Depthwise 3×3 + pointwise 1×1, each with BatchNorm and ReLU6 (MobileNet v1 block)."""
    return nn.Sequential(nn.Conv2d(c_in, c_in, 3, stride, 1, groups=c_in, bias=False), nn.BatchNorm2d(c_in),
                         nn.ReLU6(), nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU6())


class MobileNetLite(nn.Module):
    def __init__(self, classes: int = 100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6())
        plan = [(32, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 512, 2)]
        self.blocks = nn.Sequential(*[separable(*p) for p in plan])
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


def trained_like(model: nn.Module, seed: int) -> nn.Module:
    """BatchNorm statistics of a trained network (fresh ones are the identity)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


def rel_mse(model, other, batches) -> float:
    num = den = 0.0
    with torch.no_grad():
        for b in batches:
            r, q = model(*b), other(*b)
            r = r.last_hidden_state if hasattr(r, "last_hidden_state") else r
            q = q.last_hidden_state if hasattr(q, "last_hidden_state") else q
            num += float((q.double() - r.double()).pow(2).sum())
            den += float(r.double().pow(2).sum())
    return num / den


def run(name: str, model: nn.Module, batches, tolerance: float, activations: bool, out: Path):
    graph = sparta.capture(model, batches[0])
    t0 = time.perf_counter()
    report = calibrate(graph, batches, tolerance, activations=activations, target="cpu")
    seconds = time.perf_counter() - t0
    independent = None
    if not activations:
        swapped = copy.deepcopy(model)
        state = swapped.state_dict()
        state.update(fake_quantized_weights(graph))
        swapped.load_state_dict(state)
        independent = rel_mse(model, swapped, batches)
    tag = f"{name.split()[0].lower().replace('-style', '')}_{'wa' if activations else 'w'}"
    report.plot(out.parent / f"quantization_{tag}.png")
    lowered = report.lowered()
    weights = [d for d in report.decisions if d.kind == "weight"]
    acts = [d for d in report.decisions if d.kind == "activation"]
    head = (f"## {name}: tolerance {tolerance:g} per op, {'weights + activations' if activations else 'weights only'}\n\n"
            f"- weights lowered: {sum(d.kind == 'weight' for d in lowered)} of {len(weights)}; activations lowered: "
            f"{sum(d.kind == 'activation' for d in lowered)} of {len(acts)}\n"
            f"- model output relative MSE vs fp32: {report.model_error:.3e} (calibration walk)"
            + (f", {independent:.3e} (torch model with the calibrated weights)" if independent is not None else "")
            + f"\n- calibration time: {seconds:.1f} s on {torch.get_num_threads()} CPU threads, {len(batches)} batches\n"
            f"- plot: `quantization_{tag}.png`\n\n")
    rows = ["| tensor | kind | bits | runs at | added rel. MSE |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{d.tensor}` | {d.kind} | {d.bits_before} → {d.bits}{f' (with `{d.by}`)' if d.by else ''} | {d.runs} "
             f"| {'—' if d.by else f'{d.error:.2e}'} |" for d in lowered]
    kept = [d for d in report.decisions if d not in lowered]
    tail = (f"\n\nKept at full precision ({len(kept)}): "
            + ", ".join(f"`{d.tensor}` ({min(d.trials.values()):.1e} at {min(d.trials)} bits)"
                        for d in kept if d.trials) + ("none" if not kept else "") + "\n")
    return head + "\n".join(rows) + tail, seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "quantization.md"))
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    sections = []

    cnn = trained_like(MobileNetLite(), seed=1)
    g = torch.Generator().manual_seed(2)
    images = [(torch.randn(8, 3, 64, 64, generator=g),) for _ in range(4)]
    for acts in (False, True):
        sections.append(run("MobileNet-style CNN", cnn, images, args.tolerance, acts, out)[0])

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers)).eval()
    g = torch.Generator().manual_seed(3)
    tokens = [(torch.randint(0, 30522, (2, 128), generator=g),) for _ in range(4)]
    for acts in (False, True):
        sections.append(run(f"BERT-base ({args.layers} layers, 4 batches of 2x128 tokens)", bert, tokens,
                            args.tolerance, acts, out)[0])

    text = "\n".join(["# Quantization by calibration", "",
                      "Command: `python examples/quantize_calibration.py` "
                      f"(date {time.strftime('%Y-%m-%d')}, torch {torch.__version__}). Models are random init, "
                      "so which layers survive int4 says more about the method than about trained models.", "",
                      *sections])
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
