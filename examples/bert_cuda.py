"""BERT-base for a GPU: prune its encoder linears in blocks, compile for CUDA (no GPU needed), save.

    python examples/bert_cuda.py --out artifacts/bert_cuda          # here: TVM + nvcc, no GPU
    python benchmarks/bench_e2e_bert.py artifacts/bert_cuda         # on the GPU: load (no TVM), verify, time

The model is BERT-base from its config (12 layers, 768 hidden, 3072 FFN), fp16, run on
``--batch × --seq`` tokens. Each encoder linear keeps the ``--density`` fraction of its
``--block``-square blocks with the largest L2 norm (magnitude block pruning).
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import sparta

LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")


def magnitude_block_mask(weight: torch.Tensor, block: int, density: float) -> torch.Tensor:
    """Keep the ``density`` fraction of ``block × block`` blocks with the largest L2 norm."""
    n, k = weight.shape
    norms = weight.float().reshape(n // block, block, k // block, block).pow(2).sum(dim=(1, 3))
    keep = torch.zeros(norms.numel(), dtype=torch.bool)
    keep[norms.flatten().argsort(descending=True)[: round(density * norms.numel())]] = True
    return keep.reshape(norms.shape).repeat_interleave(block, 0).repeat_interleave(block, 1)


def pruned_bert(layers: int, block: int, density: float, parts=LINEARS, seed: int = 0):
    """BERT-base (fp16) from config and a TeSA pruning each chosen encoder linear in blocks."""
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=layers)).eval().half()
    params = dict(model.named_parameters())
    tesa = {}
    for i in range(layers):
        for part in parts:
            name = f"encoder.layer.{i}.{part}.weight"
            tesa[name] = sparta.TeSA.from_mask(magnitude_block_mask(params[name], block, density))
    return model, tesa


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/bert_cuda")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--block", type=int, default=32, choices=(32, 64))
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()

    model, tesa = pruned_bert(args.layers, args.block, args.density)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"BERT-base, {args.layers} layers, fp16, {args.batch}x{args.seq} tokens; {len(tesa)} encoder linears keep "
          f"{args.density:.0%} of their {args.block}x{args.block} blocks")
    t0 = time.perf_counter()
    compiled = sparta.compile(model, tesa, (ids,), target="cuda")
    print(f"compiled for CUDA in {time.perf_counter() - t0:.1f} s "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in compiled.timings.items())})")
    print(compiled.kernel_report())
    path = compiled.save(args.out)
    print(f"saved to {path}; run it on a GPU with: python benchmarks/bench_e2e_bert.py {path}")


if __name__ == "__main__":
    main()
