"""One compile, every shape: BERT-base compiled once with ``dynamic=True``, called at many (batch, sequence).

    python benchmarks/bench_dynamic_bert.py                     # CPU: {1, 3, 8, 32} x {1, 17, 128, 512}
    python benchmarks/bench_dynamic_bert.py --batches 1 3 --seqs 1 17 128
    python examples/bert_cuda.py --batch 8 --vocab 8192 --out artifacts/bert_dynamic             # TVM + nvcc
    python benchmarks/bench_dynamic_bert.py --saved artifacts/bert_dynamic                       # the GPU
    python examples/bert_cuda.py --batch 8 --vocab 2048 --attention-mask --out artifacts/bert_padded
    python benchmarks/bench_dynamic_bert.py --padded artifacts/bert_padded --saved artifacts/bert_dynamic   # GPU

BERT-base from its config, every encoder linear keeping 10% of its 32×32 blocks (random, seeded), compiled once at
the example shape ``--example`` (the plan is made there). Each (batch, sequence): the compiled model's output against
the masked dense model (the same graph run with torch ops on the masked weights; worst relative error) and the median
time of both, interleaved. ``--padded``: a model compiled with ``(input_ids, attention_mask)``, called with random
right padding at every shape (``--mask-seed``), against its masked dense graph at the unpadded positions, and timed
against the model of ``--saved`` (the same BERT without a mask input) at the same shapes. ``--saved``: a model compiled for CUDA (``examples/bert_cuda.py``: fp16, 10% of
the 32×32 blocks with the largest norm), loaded without TVM and called as ``sparta.load`` returns it (Inductor and one
CUDA graph per shape), against its masked dense graph in torch ops (verified; timed eagerly) and Hugging Face's dense
``BertModel`` (fp16, sdpa) through ``torch.compile(dynamic=True)`` in ``default`` and ``reduce-overhead`` mode (one
compile each, as sparta's); times by the host clock, synchronised.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_busy_us, interleaved, save  # noqa: E402

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


def run_saved(args):
    """The GPU run: one saved model at every (batch, sequence), verified against its masked dense graph."""
    from bench_e2e_bert import hf_bert
    from common import first_tensor, gpu_wall_us
    compiled = sparta.load(args.saved).to("cuda")
    reference = compiled.reference().to("cuda")
    hf = hf_bert(compiled.graph, "cuda")
    peers = {} if args.static_peers else {           # one compile each, as sparta's
        f"dense_compile_{mode}": torch.compile(hf, mode=mode, dynamic=True) for mode in ("default", "reduce-overhead")}
    vocab = compiled.graph.tensor("embeddings.word_embeddings.weight").shape[0]
    gen = torch.Generator().manual_seed(2)
    rows, name = [], args.name or ("static_peers_bert_cuda" if args.static_peers else "dynamic_bert_cuda")
    print(f"{args.saved}: dynamic dims {compiled.graph.meta['dynamic_dims']}; {torch.cuda.get_device_name()}")
    with torch.no_grad():
        for batch in args.batches:
            for seq in args.seqs:
                ids = torch.randint(0, vocab, (batch, seq), generator=gen).cuda()
                want = reference(ids)[0].float()
                got = first_tensor(compiled(ids)).float()
                err = float((got - want).abs().max() / want.abs().max())
                us = {"sparta": gpu_wall_us(lambda i: compiled(ids), 1, 20, WINDOWS),
                      "dense": gpu_wall_us(lambda i: reference(ids), 1, 20)}
                row = {"batch": batch, "seq": seq, "rel_err": err}
                static = _static_peers(hf, reference, args.static_peers) if args.static_peers else {}
                for peer, (fn, call) in (static or {k: (v, "hf") for k, v in peers.items()}).items():
                    for _ in range(3):
                        _call(fn, call, ids)
                    us[peer] = gpu_wall_us(lambda i: _call(fn, call, ids), 1, 20, WINDOWS)
                compiled_peers = {k: v for k, v in us.items() if "_compile_" in k}
                best = min(compiled_peers.values())
                row.update({"sparta_us": us["sparta"], "dense_us": us["dense"], "speedup": us["dense"] / us["sparta"],
                            "us": us, "speedup_vs_best_dense_compile": best / us["sparta"]})
                if static:
                    graph_best = min((k for k in compiled_peers if k.startswith("graph_")), key=us.get)
                    row["speedup_vs_best_graph_compile"] = us[graph_best] / us["sparta"]
                    row["gpu_us"] = {"sparta": _gpu_split(lambda: compiled(ids)),
                                     graph_best: _gpu_split(lambda: _call(*static[graph_best], ids))}
                rows.append(row)
                dense = " / ".join(f"{k.replace('_compile_', ' ')} {v:.1f}" for k, v in compiled_peers.items())
                print(f"  {batch:3d} x {seq:4d}: rel. err {err:.1e}  sparta {us['sparta']:8.1f} us  masked dense "
                      f"eager {us['dense']:8.1f} us  torch.compile: {dense} us  ({best / us['sparta']:.2f}x the "
                      f"best){_gpu_note(row)}", flush=True)
                modes = args.static_peers or ["default", "reduce-overhead"]
                path = save(name, {"saved": args.saved, "peer_modes": modes, "peers_dynamic": not args.static_peers,
                                   "rows": rows})                       # each row as it comes
    print(path)


WINDOWS = 5                 # timed windows per measured call; their median is reported
KERNEL_KINDS = (("attention", ("fmha", "flash", "attention", "sdpa")),
                ("linears", ("bsr_", "gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem", "_mm_", "addmm")))


def _call(fn, call: str, ids):
    return fn(input_ids=ids) if call == "hf" else fn(ids)


def _gpu_split(fn) -> dict:
    """GPU time of one call by kernel kind (linears, attention, the rest), from the profiler."""
    kernels = {}
    total = gpu_busy_us(fn, by_kernel=kernels, top=None)
    split = {"total": round(total, 1)}
    for key, (t, _) in kernels.items():
        low = key.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in low for w in words)), "rest")
        split[kind] = round(split.get(kind, 0.0) + t, 1)
    return split


def _gpu_note(row) -> str:
    if "gpu_us" not in row:
        return ""
    return "; GPU us " + ", ".join(f"{k}: {v}" for k, v in row["gpu_us"].items())


def _static_peers(hf, graph, modes):
    """Dense ``torch.compile`` for the next call's shape alone, one per mode (compiled afresh): Hugging Face's model
    (``dense_compile_<mode>``) and the same graph as sparta's in dense torch ops on the masked weights
    (``graph_compile_<mode>``)."""
    out = {}
    for mode in modes:
        torch._dynamo.reset()
        out[f"dense_compile_{mode}"] = (torch.compile(hf, mode=mode, dynamic=False), "hf")
        out[f"graph_compile_{mode}"] = (torch.compile(graph, mode=mode, dynamic=False), "graph")
    return out


def run_padded(args):
    """The GPU run of a model taking ``(input_ids, attention_mask)``: random right padding at every (batch,
    sequence); the unpadded positions against the masked dense graph; time against the unmasked saved model's."""
    from common import gpu_wall_us
    padded = sparta.load(args.padded).to("cuda")
    reference = padded.reference().to("cuda")
    plain = sparta.load(args.saved).to("cuda") if args.saved else None
    vocab = padded.graph.tensor("embeddings.word_embeddings.weight").shape[0]
    gen = torch.Generator().manual_seed(args.mask_seed)
    rows = []
    print(f"{args.padded}: {torch.cuda.get_device_name()}; shapes line: {padded.shapes_line()}")
    with torch.no_grad():
        for batch in args.batches:
            for seq in args.seqs:
                ids = torch.randint(0, vocab, (batch, seq), generator=gen)
                lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
                mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
                ids, mask = ids.cuda(), mask.cuda()
                keep = mask.bool()
                want = reference(ids, mask)[0].float()[keep]
                got = padded(ids, mask).last_hidden_state.float()[keep]
                err = float((got - want).abs().max() / want.abs().max())
                us = {"padded": gpu_wall_us(lambda i: padded(ids, mask), 1, 20, WINDOWS)}
                if plain is not None:
                    us["no_mask"] = gpu_wall_us(lambda i: plain(ids), 1, 20, WINDOWS)
                row = {"batch": batch, "seq": seq, "padded_tokens": int((~keep).sum()), "rel_err": err, "us": us}
                if plain is not None:
                    row["padded_vs_no_mask"] = us["padded"] / us["no_mask"]
                rows.append(row)
                print(f"  {batch:3d} x {seq:4d}: {row['padded_tokens']:5d} padded, rel. err {err:.1e}  padded "
                      f"{us['padded']:8.1f} us" + (f"  no mask {us['no_mask']:8.1f} us ({row['padded_vs_no_mask']:.2f}x)"
                                                   if plain is not None else ""), flush=True)
                path = save(args.name or "padded_bert_cuda", {"padded": args.padded, "no_mask": args.saved,
                                                              "rows": rows})
    print(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 3, 8, 32])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 17, 128, 512])
    ap.add_argument("--example", type=int, nargs=2, default=[8, 128], metavar=("BATCH", "SEQ"))
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--saved", help="a saved CUDA model compiled dynamic (run on the GPU)")
    ap.add_argument("--name", help="with --saved: the results file's name")
    ap.add_argument("--padded", help="a saved CUDA model taking (input_ids, attention_mask): padded batches (GPU)")
    ap.add_argument("--mask-seed", type=int, default=4)
    ap.add_argument("--static-peers", nargs="+", metavar="MODE",
                    help="with --saved: the dense peers compiled for each shape alone in these torch.compile modes "
                         "(e.g. default reduce-overhead max-autotune), instead of once with dynamic=True")
    args = ap.parse_args()
    if args.padded:
        return run_padded(args)
    if args.saved:
        return run_saved(args)
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
