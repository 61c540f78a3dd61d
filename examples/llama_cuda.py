"""A LLaMA-style decoder for a GPU: prune every linear in blocks, compile for CUDA (no GPU needed), save.

    python examples/llama_cuda.py --out artifacts/llama_dynamic      # here: TVM + nvcc, no GPU; any length
    python benchmarks/bench_e2e_llama.py artifacts/llama_dynamic --tokens 512 1   # on the GPU
    python examples/llama_cuda.py --static --tokens 512 --out artifacts/llama_prefill   # one shape only

The model is Hugging Face's ``LlamaModel`` from a config (hidden 2048, intermediate 5632, 16 heads, ``--layers``
layers), fp16 (``--dtype bfloat16``: bf16, sparta's kernels in bf16), on one sequence of ``--tokens`` tokens without a KV cache (``--tokens 1``: the work of one decode step
of the linears). Each linear of the decoder layers keeps the ``--density`` fraction of its ``--block``-square blocks
with the largest L2 norm. One model serves every batch and sequence length (the example's ``--tokens`` trace it; the
plan is costed from 1 token to them): its kernels take any number of rows, each linear picks per call its GEMV (up to
4 tokens) or the tile kernel of the call's bucket of rows. ``--static``: a model of the example's shape only.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import sparta
from bert_cuda import magnitude_block_mask      # the same magnitude block pruning (examples/)

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def llama_config(layers: int, vocab: int) -> transformers.LlamaConfig:
    # random weights of std 0.1 (the config's default 0.02 leaves the MLPs' share of the residual stream below fp16's
    # resolution: kernels that computed nothing would still verify)
    return transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                    num_attention_heads=16, num_key_value_heads=16, vocab_size=vocab, use_cache=False,
                                    initializer_range=0.1)


def pruned_llama(layers: int, block: int, density: float, vocab: int, seed: int = 0, dtype=torch.float16):
    """The decoder (fp16 or bf16) from its config and a TeSA pruning each decoder linear in blocks."""
    torch.manual_seed(seed)
    model = transformers.LlamaModel(llama_config(layers, vocab)).eval().to(dtype)
    params = dict(model.named_parameters())
    tesa = {f"layers.{i}.{part}.weight": sparta.TeSA.from_mask(
        magnitude_block_mask(params[f"layers.{i}.{part}.weight"], block, density))
        for i in range(layers) for part in LINEARS}
    return model, tesa


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/llama_cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block", type=int, default=32, choices=(32, 64))
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--static", action="store_true", help="a model of the example's shape only (dynamic=False)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"), help="the model's 16-bit type")
    ap.add_argument("--vocab", type=int, default=4096,
                    help="embedding rows (fewer: a smaller save; the decoder's work is the same)")
    args = ap.parse_args()

    model, tesa = pruned_llama(args.layers, args.block, args.density, args.vocab, dtype=getattr(torch, args.dtype))
    batch = 1 if args.static else 2          # a traced batch of 1 would stay 1 (torch.export keeps sizes 0 and 1)
    ids = torch.randint(0, args.vocab, (batch, args.tokens), generator=torch.Generator().manual_seed(0))
    print(f"LLaMA-style decoder, {args.layers} layers, {args.dtype}, {batch}x{args.tokens} tokens"
          f"{'' if args.static else ' (any batch and sequence length)'}; {len(tesa)} linears keep "
          f"{args.density:.0%} of their {args.block}x{args.block} blocks")
    t0 = time.perf_counter()
    compiled = sparta.compile(model, tesa, (ids,), target="cuda", dynamic=False if args.static else None)
    print(f"compiled for CUDA in {time.perf_counter() - t0:.1f} s "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in compiled.timings.items())})")
    print(compiled.plan_report(only_gemm=True))
    path = compiled.save(args.out)
    print(f"saved to {path}; run it on a GPU with: python benchmarks/bench_e2e_llama.py {path}")


if __name__ == "__main__":
    main()
