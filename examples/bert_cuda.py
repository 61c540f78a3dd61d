"""BERT-base for a GPU: prune its encoder linears in blocks, compile for CUDA (no GPU needed), save.

    python examples/bert_cuda.py --batch 8 --out artifacts/bert_cuda    # here: TVM + nvcc, no GPU; every shape
    python benchmarks/bench_dynamic_bert.py --saved artifacts/bert_cuda # on the GPU: every (batch, sequence)
    python examples/bert_cuda.py --static --out artifacts/bert_static   # one shape (32 x 128)
    python examples/bert_cuda.py --attention-mask --out artifacts/bert_padded   # (input_ids, attention_mask)
    python benchmarks/bench_e2e_bert.py artifacts/bert_static           # on the GPU: load (no TVM), verify, time

The model is BERT-base from its config (12 layers, 768 hidden, 3072 FFN), fp16, run on
``--batch × --seq`` tokens. Each encoder linear keeps the ``--density`` fraction of its
``--block``-square blocks with the largest L2 norm (magnitude block pruning). With ``--w8a8``,
calibration on ``--calib`` random batches fits int8 weights (per channel) and per-token int8
activations for the linears the tolerance allows: they run sparta's W8A8 tensor-core kernels, and
each LayerNorm that feeds them emits their int8 codes. One model serves every batch and sequence length (the example's
shape traces it; the plan is costed from 1 token to its tokens); ``--static``: the example's shape only.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import sparta
from sparta.sampling import padding_mask

LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")


def magnitude_block_mask(weight: torch.Tensor, block: int, density: float) -> torch.Tensor:
    """Keep the ``density`` fraction of ``block × block`` blocks with the largest L2 norm."""
    n, k = weight.shape
    norms = weight.float().reshape(n // block, block, k // block, block).pow(2).sum(dim=(1, 3))
    keep = torch.zeros(norms.numel(), dtype=torch.bool)
    keep[norms.flatten().argsort(descending=True)[: round(density * norms.numel())]] = True
    return keep.reshape(norms.shape).repeat_interleave(block, 0).repeat_interleave(block, 1)


def pruned_bert(layers: int, block: int, density: float, parts=LINEARS, seed: int = 0, vocab: int = 30522):
    """BERT-base (fp16) from config and a TeSA pruning each chosen encoder linear in blocks."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(num_hidden_layers=layers, vocab_size=vocab)
    model = transformers.BertModel(config).eval().half()
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
    ap.add_argument("--vocab", type=int, default=30522,
                    help="embedding rows (fewer: a smaller save; the encoder's work is the same)")
    ap.add_argument("--static", action="store_true", help="a model of the example's shape only (dynamic=False)")
    ap.add_argument("--attention-mask", action="store_true",
                    help="the model takes (input_ids, attention_mask): padded batches, as BERT is called")
    ap.add_argument("--w8a8", action="store_true", help="calibrate to int8 weights and activations")
    ap.add_argument("--calib", type=int, default=2, help="calibration batches (with --w8a8)")
    ap.add_argument("--tolerance", type=float, default=1e-2, help="relative output MSE one op may add (--w8a8)")
    args = ap.parse_args()

    model, tesa = pruned_bert(args.layers, args.block, args.density, vocab=args.vocab)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"BERT-base, {args.layers} layers, fp16, {args.batch}x{args.seq} tokens; {len(tesa)} encoder linears keep "
          f"{args.density:.0%} of their {args.block}x{args.block} blocks")
    t0 = time.perf_counter()
    quant = {}
    if args.w8a8:
        gen = torch.Generator().manual_seed(1)
        quant = dict(calibration=[(torch.randint(0, model.config.vocab_size, ids.shape, generator=gen),)
                                  for _ in range(args.calib)],
                     quant_tolerance={"tolerance": args.tolerance, "widths": (8,), "activations": True})
    mask = padding_mask(ids.shape, torch.long, torch.Generator().manual_seed(3))     # right padding, 1..seq kept
    inputs = (ids, mask) if args.attention_mask else (ids,)
    compiled = sparta.compile(model, tesa, inputs, target="cuda", dynamic=False if args.static else None, **quant)
    print(f"compiled for CUDA in {time.perf_counter() - t0:.1f} s "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in compiled.timings.items())})")
    print(compiled.kernel_report())
    path = compiled.save(args.out)
    print(f"saved to {path}; run it on a GPU with: python benchmarks/bench_e2e_bert.py {path}")


if __name__ == "__main__":
    main()
