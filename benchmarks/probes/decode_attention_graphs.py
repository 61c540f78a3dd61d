"""Where decode attention's tokens go wrong inside generate()'s CUDA graphs: one process per mode, each greedy-decoding
the saved decoder (built with ``SPARTA_DECODE_ATTENTION=1``) eagerly and from the step graph, tokens compared.

    python benchmarks/probes/decode_attention_graphs.py --dir DIR/saved_llama_generate [--modes ...] [--out F.json]

Modes: ``plain`` (the kernel as generate() runs it), ``ref`` (the torch reference in its place), ``clone_after`` (a
torch copy of its output before the next kernel), ``check`` (the kernel, and each call's largest difference to the
reference on the same inputs, recorded on the GPU), ``nopdl`` (no kernel launched with programmatic dependent
launch), ``nopdl_attention`` (only the decode-attention kernels without it), ``nopdl_after`` (every kernel but the
decode-attention ones without it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

MODES = ("plain", "ref", "clone_after", "check", "nopdl", "nopdl_attention", "nopdl_after")


class _Wrapped:
    """Stands for a layer's decode-attention module (hf_attention reads spec, dtype and scale_value off it)."""

    def __init__(self, kernel, mode: str, slot: int, diffs):
        self.kernel, self.mode, self.slot, self.diffs = kernel, mode, slot, diffs
        self.spec, self.dtype, self.scale_value = kernel.spec, kernel.dtype, kernel.scale_value

    def __call__(self, q, k, v, keep):
        from sparta.templates.decode_attention.spec import decode_attention_ref
        if self.mode == "ref":
            return decode_attention_ref(q, k, v, keep, self.scale_value)
        out = self.kernel(q, k, v, keep)
        if self.mode == "clone_after":
            return out.clone()
        if self.mode == "check":
            ref = decode_attention_ref(q, k, v, keep, self.scale_value)
            d = (out.float() - ref.float()).abs().amax().reshape(1)
            torch.maximum(self.diffs[self.slot:self.slot + 1], d, out=self.diffs[self.slot:self.slot + 1])
        return out


def _patch_pdl(mode: str) -> None:
    from sparta.runtime import cuda
    original = cuda.PreparedLaunch._pdl_config

    def config(self):
        attention = "decode_attention" in self.kernel.name
        off = mode == "nopdl" or (mode == "nopdl_attention" and attention) or (mode == "nopdl_after" and not attention)
        return None if off else original(self)
    cuda.PreparedLaunch._pdl_config = config


def run_mode(folder: str, mode: str) -> dict:
    import sparta
    from sparta.hf_attention import KERNEL_ATTRIBUTE
    from sparta.runtime.decode_loop import greedy_generate
    if mode.startswith("nopdl"):
        _patch_pdl(mode)
    model = sparta.load(folder).to("cuda")
    dec = model.decoder()
    layers = [m for m in dec.modules() if KERNEL_ATTRIBUTE in m.__dict__]
    diffs = torch.zeros(len(layers), device="cuda")
    for i, m in enumerate(layers):
        m.__dict__[KERNEL_ATTRIBUTE] = _Wrapped(m.__dict__[KERNEL_ATTRIBUTE], mode, i, diffs)
    result = {"mode": mode, "layers": len(layers), "cases": []}
    for batch, pad in ((1, 0), (3, 5)):
        g = torch.Generator().manual_seed(4 + batch)
        prompt = torch.randint(3, 512, (batch, 21), generator=g).cuda()
        mask = torch.ones_like(prompt)
        mask[-1, :pad] = 0
        kw = dict(attention_mask=mask, max_new_tokens=40, pad_token_id=0, eos_token_id=None)
        case = {"batch": batch, "pad": pad}
        with torch.no_grad():
            diffs.zero_()
            eager = greedy_generate(dec, prompt, graphs=False, inductor=False, **kw)
            case["eager_max_diff"] = diffs.tolist()
            diffs.zero_()
            graph = greedy_generate(dec, prompt, graphs=True, inductor=False, **kw)
            case["graph_max_diff"] = diffs.tolist()
            again = greedy_generate(dec, prompt, graphs=True, inductor=False, **kw)
            hf = model.generate(prompt, do_sample=False, disable_compile=True, **kw)
        torch.cuda.synchronize()
        first = lambda a, b: next((i for i in range(a.shape[1]) if not torch.equal(a[:, i], b[:, i])), None)  # noqa
        case.update(graph_vs_eager=first(graph, eager), again_vs_graph=first(again, graph),
                    eager_vs_hf=first(eager, hf), graph_vs_hf=first(graph, hf))
        result["cases"].append(case)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out")
    a = p.parse_args()
    if a.one:
        print("RESULT " + json.dumps(run_mode(a.dir, a.one)), flush=True)
        return
    results = []
    for mode in a.modes:
        r = subprocess.run([sys.executable, __file__, "--dir", a.dir, "--one", mode], capture_output=True, text=True,
                           env=dict(os.environ, SPARTA_DECODE_ATTENTION="1"), timeout=300)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        res = json.loads(line[7:]) if line else {"mode": mode, "error": (r.stderr or r.stdout)[-1500:]}
        print(json.dumps(res), flush=True)
        results.append(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
