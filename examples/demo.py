"""sparta's main demo: prune BERT's FFN weights in 32×32 blocks, compile, verify, inspect.

    bash dev.sh demo              # sets everything up, then runs this
    python examples/demo.py --layers 2 --sparsity 0.9 --target cpu
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import sparta


def block_mask(shape, block, density, gen):
    keep = torch.rand(shape[0] // block, shape[1] // block, generator=gen) < density
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--target", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers)).eval()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    gen = torch.Generator().manual_seed(0)
    tesa = {}
    for i in range(args.layers):
        for part in ("intermediate", "output"):
            name = f"encoder.layer.{i}.{part}.dense.weight"
            shape = dict(model.named_parameters())[name].shape
            tesa[name] = sparta.TeSA.from_mask(block_mask(shape, 32, 1 - args.sparsity, gen))

    print(f"BERT-base config, {args.layers} layers, FFN weights {args.sparsity:.0%} sparse in 32x32 blocks, "
          f"target {args.target}")
    t0 = time.perf_counter()
    compiled = sparta.compile(model, tesa, (ids,), target=args.target, verify=True)
    print(f"compiled and verified in {time.perf_counter() - t0:.1f} s "
          f"({', '.join(f'{k} {v:.2f} s' for k, v in compiled.timings.items())})")
    print()
    print(compiled.graph.propagation.table())
    print()
    print(compiled.plan_report(only_gemm=True))
    print()
    print(compiled.kernel_report())
    print()
    with torch.no_grad():
        out = compiled(ids)
        ref = model(ids)
    print("last_hidden_state", tuple(out.last_hidden_state.shape),
          "max |compiled - dense model| =", f"{(out.last_hidden_state - ref.last_hidden_state).abs().max():.3g}",
          "(the difference is the pruning itself)")


if __name__ == "__main__":
    main()
