"""One compile, every shape: BERT-base compiled once with ``dynamic=True`` (CPU), called at many (batch, sequence).

    python benchmarks/bench_dynamic_bert.py                     # {1, 3, 8, 32} x {1, 17, 128, 512}
    python benchmarks/bench_dynamic_bert.py --batches 1 3 --seqs 1 17 128

BERT-base from its config, every encoder linear keeping 10% of its 32×32 blocks (random, seeded), compiled once at
the example shape ``--example`` (the plan is made there). Each (batch, sequence): the compiled model's output against
the masked dense model (the same graph run with torch ops on the masked weights; worst relative error) and the median
time of both, interleaved.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, save  # noqa: E402

import sparta  # noqa: E402

PARTS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
         "intermediate.dense", "output.dense")


def pruned_bert(density: float):
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(1)
    tesa = {}
    for i in range(model.config.num_hidden_layers):
        for part in PARTS:
            name = f"encoder.layer.{i}.{part}.weight"
            n, k = params[name].shape
            grid = torch.rand(n // 32, k // 32, generator=g) < density
            tesa[name] = grid.repeat_interleave(32, 0).repeat_interleave(32, 1)
    return model, tesa


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 3, 8, 32])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 17, 128, 512])
    ap.add_argument("--example", type=int, nargs=2, default=[8, 128], metavar=("BATCH", "SEQ"))
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model, tesa = pruned_bert(args.density)
    gen = torch.Generator().manual_seed(2)
    example = torch.randint(0, 30522, tuple(args.example), generator=gen)
    t0 = time.perf_counter()
    compiled = sparta.compile(model, tesa, (example,), dynamic=True)
    compile_s = time.perf_counter() - t0
    reference = compiled.reference()
    sparse = sum(p.kind == "sparse" for p in compiled.plan.ops.values())
    print(f"compiled once in {compile_s:.0f} s at {tuple(args.example)}: {sparse} sparse ops, dynamic dims "
          f"{compiled.graph.meta['dynamic_dims']}")
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            for seq in args.seqs:
                ids = torch.randint(0, 30522, (batch, seq), generator=gen)
                got, want = compiled(ids).last_hidden_state, reference(ids)[0]
                err = float((got - want).abs().max() / want.abs().max())
                ms = interleaved({"sparta": lambda: compiled(ids), "dense": lambda: reference(ids)}, args.reps)
                rows.append({"batch": batch, "seq": seq, "rel_err": err, "sparta_ms": ms["sparta"],
                             "dense_ms": ms["dense"], "speedup": ms["dense"] / ms["sparta"]})
                print(f"  {batch:3d} x {seq:4d}: rel. err {err:.1e}  sparta {ms['sparta']:9.2f} ms  "
                      f"dense {ms['dense']:9.2f} ms  ({ms['dense'] / ms['sparta']:.2f}x)", flush=True)
    print(save("dynamic_bert", {"example": args.example, "density": args.density, "compile_s": compile_s,
                                "sparse_ops": sparse, "rows": rows}))


if __name__ == "__main__":
    main()
