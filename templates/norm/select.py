"""Selection rules of the norm family (the ``norm_cuda`` table, ``templates/registry.py``), run by the fusion pass
(``passes/transform/groups.py``) once the GEMMs' kernels are chosen, for each 16-bit LayerNorm (and an fp32 one
whose int8 codes W8A8 linears read): one over its last dimension, with constant parameters, runs sparta's kernel."""

from __future__ import annotations

import torch

from ...passes.transform.groups import NormSite
from ...passes.transform.plan import KernelChoice
from ..registry import rule


def torch_norm(rule_name: str, reason: str) -> KernelChoice:
    return KernelChoice("torch", rule_name, reason)


@rule("norm_cuda", 1)
def last_dimension(site: NormSite):
    if list(site.op.attrs.get("normalized_shape", [])) != [site.width]:
        return torch_norm("last_dimension", "normalises more than the last dimension")
    if site.width % 8:
        return torch_norm("last_dimension", f"width {site.width} is not a multiple of 8")
    return None


@rule("norm_cuda", 2)
def constant_parameters(site: NormSite):
    for role in ("weight", "bias"):
        if getattr(site, role) == "other":
            return torch_norm("constant_parameters", f"the {role} is not a constant")
    if site.bias is not None and site.weight is None:
        return torch_norm("constant_parameters", "a bias without a weight")
    return None


@rule("norm_cuda", 90)
def layer_norm(site: NormSite):
    dtype = "bfloat16" if site.dtype == torch.bfloat16 else "float16"
    why = "Welford LayerNorm" + (f"; per-token int8 codes for {', '.join(site.int8_readers)}"
                                 if site.int8_readers else "")
    return KernelChoice("norm", "layer_norm", why, dtype)
