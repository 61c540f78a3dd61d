"""A researcher's loop: prune → compile → profile → keep what pays, at rising sparsity.

    python examples/prune_loop.py                        # BERT (4 layers) on the CPU, 50/70/90% of 32x32 blocks
    python examples/prune_loop.py --sparsity 0.8 --layers 12

Each round prunes every encoder linear by block magnitude, compiles, profiles one forward op by op against the dense
reference (``compiled.profile``), puts the sparse ops that measured slower than their dense op back on it
(``compiled.run_dense``) and reports the forward's time against the dense model's and the output's error against the
pruned model's. The table at the end is what the loop found; ``--out`` keeps the last model.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import sparta
from bert_cuda import magnitude_block_mask      # the same magnitude block pruning (examples/)

PARTS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
         "intermediate.dense", "output.dense")


def prune_round(model, sparsity: float, ids: torch.Tensor, block: int = 32, reps: int = 5) -> tuple[dict, object]:
    """One round at ``sparsity``: the compiled model and what its profile says."""
    params = dict(model.named_parameters())
    tesa = {name: sparta.TeSA.from_mask(magnitude_block_mask(params[name], block, 1 - sparsity))
            for name in params if name.endswith(".weight") and any(f".{p}." in name for p in PARTS)}
    compiled = sparta.compile(model, tesa, (ids,), dynamic=False)
    first = compiled.profile(ids, reps=reps)
    slow = first.slower_than_dense(1.1)
    if slow:
        compiled.run_dense(slow, "measured slower than dense in the loop's profile")
    final = compiled.profile(ids, reps=reps) if slow else first
    with torch.no_grad():
        err = float((compiled(ids).last_hidden_state - compiled.reference()(ids)[0]).abs().max())
    row = {"sparsity": sparsity, "sparse_ops": len(final.sparta_ops()), "run_dense": len(slow),
           "forward_us": final.forward_us, "dense_forward_us": final.dense_forward_us,
           "speedup": final.dense_forward_us / final.forward_us, "max_abs_err": err}
    return row, compiled


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", help="save the last round's model here")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(1))
    rows, compiled = [], None
    for sparsity in args.sparsity:
        row, compiled = prune_round(model, sparsity, ids)
        rows.append(row)
        print(f"{sparsity:.0%}: {row['sparse_ops']} sparse ops ({row['run_dense']} put back on dense), forward "
              f"{row['forward_us'] / 1e3:.2f} ms against dense {row['dense_forward_us'] / 1e3:.2f} ms "
              f"({row['speedup']:.2f}x), max abs error {row['max_abs_err']:.2e}", flush=True)
    print(compiled.profile(ids).report(top=8))
    if args.out:
        print(f"saved to {compiled.save(args.out)}")


if __name__ == "__main__":
    main()
