"""Kernel selection for ``target="cuda"``: which kernel runs each planned GEMM, as an ordered table of rules.

Each rule is a small function ``(site, target) -> KernelChoice | None`` (TVM dlight's schedule rules, torchao's
``(condition, impl)`` table); the first that answers wins, and the last always does. A site is what the plan and
the graph say about one GEMM (:class:`GemmSite`); the measured tile tables come from the :class:`~sparta.target.Target`
(``passes/profiles/cuda_kernels.json``). The choice lands in the plan (``OpPlan.kernel``), which the plan report
shows and codegen builds exactly; where no kernel honours the plan (a width it cannot run, an op it cannot take)
the choice says so in ``note``. Nothing here needs TVM or a GPU.

The table is ``gemm_cuda`` of the kernel-family registry (``templates/registry.py``): the guards below, then each
family's rules from its ``select.py`` (``templates/<family>/select.py``), by order. Adding a kernel variant: a rule in
its family's folder, its tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graph import Graph, Op
from ..passes.transform.groups import fuse
from ..passes.fusion import fused_activation, fused_gate, is_gated
from ..passes.transform.plan import KernelChoice, OpPlan, Plan
from ..passes.transform.transform_op import computes_every_element, gemm_bias, gemm_view, weight_matrix
from ..target import Target
from ..templates.registry import epilogue_of, rule, rules
from ..templates.w4a16_gemv.spec import gemv_group
from .bucket_costs import bucket_estimates, dense_switch_rows, dense_widths, dequant_us
from .kept_blocks import KeepGrid, keep_grid, kept_block_mask
from .select_attention import select_attention
from .select_conv import select_convolutions

GEMM_OPS = ("linear", "addmm", "mm", "matmul")
ROW_BUCKETS = (8, 12, 16)         # the low-bit few-row GEMVs' buckets of rows in a graph of any rows


@dataclass
class GemmSite:
    """What selection reads about one planned GEMM."""

    op: Op
    plan: OpPlan
    m: int
    n: int
    k: int
    bits: str                      # "W8A8", "W4A16", "W16A16" (the plan's sub-operators), or "mixed"
    dense: bool                    # every weight element kept
    side: int                      # block side of the plan's cover (32 or 64)
    bias: str                      # "none" | "vector" | "other"
    act: str                       # the fused epilogue activation ("none", "relu", "gelu": exact)
    requantized: bool              # its (activated) output is written as int8 codes at a static scale
    weight_value: torch.Tensor | None   # (N, K) fp32, pruned elements zero; None: computed on first read of weight
    w4_group: int                  # the W4A16 GEMV's scale group for the plan's 4-bit scales, 0 if none fits
    w4_refusal: str                # why the 4-bit scales do not suit the kernels ("" where they do)
    any_rows: bool = False         # the graph was captured dynamic: kernels take any number of rows (m: the hint)
    act16: str = "float16"         # the 16-bit activations' type: "float16", or "bfloat16" for a bf16 model
    gate: bool = False             # the epilogue computes a gated unit act(gate)·up of the output's halves
    formats: tuple = ()            # the sub-operators' (weight format, activation format) pairs (sparta.formats)
    graph: Graph | None = None     # where the weight is read from (sites built by gemm_site)
    keep: KeepGrid | None = None   # the kept elements by blocks (kept_blocks.keep_grid), None: by the weight

    @property
    def weight(self) -> torch.Tensor:
        """The (N, K) weight in fp32, pruned elements zero: built on first read (only packing low-bit kernels needs
        it; masks come from :meth:`block_mask`)."""
        if self.weight_value is None:
            w = weight_matrix(self.graph, self.op) if self.op.op in GEMM_OPS else torch.zeros(0, 0)
            if self.op.op in GEMM_OPS and (w.is_meta or not computes_every_element(self.plan)):
                keep = self.plan.kept(self.n, self.k)
                # a meta weight (compiled from the meta device): its kept elements stand for nonzeros
                w = keep.to(torch.float32) if w.is_meta else torch.where(keep, w, 0.0)
            self.weight_value = w
        return self.weight_value

    def fast(self, bn: int, bk: int, gate_n: int = 0) -> bool:
        """Whether :meth:`block_mask` and packing read the covers' blocks (not the fp32 weight)."""
        return self.keep is not None and self.graph is not None and self.keep.fits(bn, bk, gate_n)

    def block_mask(self, bn: int, bk: int, gate_n: int = 0) -> torch.Tensor:
        """``block_mask_of`` the weight in ``bn × bk`` blocks (a gated kernel's ``gate_padded`` rows, ``gate_n`` =
        N): the blocks with a kept nonzero."""
        if self.fast(bn, bk, gate_n):
            return kept_block_mask(self.graph.tensor(gemm_view(self.graph, self.op)[1]), self.keep, bn, bk, gate_n)
        from ..templates.bsr_linear.packing import block_mask_of
        from ..templates.bsr_linear.spec import gate_padded
        return block_mask_of(gate_padded(self.weight, gate_n, bn) if gate_n else self.weight, bn, bk)


def choice(kernel: str, rule: str, reason: str, dtype: str = "float16", tiles: dict | None = None,
           hopper: dict | None = None, note: str = "", gemv: dict | None = None,
           buckets: list | None = None, few_rows: list | None = None, dense_grid: bool = False,
           dense_from: int | None = None) -> KernelChoice:
    return KernelChoice(kernel, rule, reason, dtype, dict(tiles or {}), hopper, note, gemv, buckets, few_rows,
                        dense_grid, dense_from=dense_from)


# ---- the guards, first in the table ----------------------------------------------------------------------------
@rule("gemm_cuda", 0)
def not_a_gemm(site: GemmSite, target: Target):
    if site.op.op not in GEMM_OPS:
        return choice("torch", "not_a_gemm", f"not a GEMM the CUDA template takes ({site.op.op})")
    return None


@rule("gemm_cuda", 1)
def k_alignment(site: GemmSite, target: Target):
    if site.k % 8:
        return choice("torch", "k_alignment", f"K={site.k} is not a multiple of 8")
    return None


@rule("gemm_cuda", 2)
def bias_shape(site: GemmSite, target: Target):
    if site.bias == "other":
        return choice("torch", "bias_shape", "bias is not a constant vector")
    return None


@rule("gemm_cuda", 5)
def not_a_format_we_run(site: GemmSite, target: Target):
    """fp8, nf4, or bf16 in a float16 model (...): no sparta CUDA kernel runs it; never another format instead."""
    runs = ("int4", "int8", "bf16" if site.act16 == "bfloat16" else "fp16", "fp32")
    for role, fmt in ((role, f) for pair in site.formats for role, f in zip(("weights", "activations"), pair)):
        if fmt not in runs:
            return choice("torch", "not_a_format_we_run", f"{fmt} {role}: no sparta CUDA kernel for {fmt} yet; runs "
                          "as a torch op at the model's dtype")
    return None


# ---- sites and the pass ----------------------------------------------------------------------------------------
def gemm_site(graph: Graph, op: Op, op_plan: OpPlan, plan: Plan | None = None) -> GemmSite | None:
    """The facts selection reads about a planned GEMM (None: not a GEMM sparta can see as one)."""
    view = gemm_view(graph, op)
    if view is None:
        return None
    _, weight_name, _, m, n, k = view
    widths = {(s.weight_bits, s.act_bits) for s in op_plan.subops}
    bits = f"W{next(iter(widths))[0]}A{next(iter(widths))[1]}" if len(widths) == 1 else "mixed"
    grid = keep_grid(op, op_plan, n, k)
    dense = grid.all() if grid is not None else bool(op_plan.kept(n, k).all())
    side = 64 if max((max(s.block) for s in op_plan.subops if s.block is not None), default=32) >= 64 else 32
    bias_name = gemm_bias(op)
    bias = "none" if bias_name is None else \
        "vector" if graph.tensor(bias_name).shape == (n,) and graph.tensor(bias_name).has_data else "other"
    fused, unit = fused_activation(graph, op, op_plan), fused_gate(graph, op, op_plan)
    act = unit.activation if unit is not None else op_plan.epilogue[-1] if fused is not None else "none"
    out = unit.mul.outputs[0] if unit is not None else (fused or op).outputs[0]
    group, refusal = 0, ""
    if bits == "W4A16":
        quant = op_plan.weight_quant.get(4)
        if quant is None:
            refusal = "no fitted 4-bit scales"
        elif quant.group < k and quant.group % 32:
            refusal = f"W4A16 kernels need scale groups of a multiple of 32 columns, not {quant.group}"
        else:
            group = gemv_group(quant.group, k)
    requantized = plan is not None and out in plan.static_scales
    act16 = "bfloat16" if graph.tensor(view[0]).dtype == torch.bfloat16 else "float16"
    return GemmSite(op, op_plan, m, n, k, bits, dense, side, bias, act, requantized,
                    None, group, refusal, graph.any_rows, act16, unit is not None,
                    tuple(dict.fromkeys((s.weight_format, s.act_format) for s in op_plan.subops)), graph, grid)


def select_gemm(site: GemmSite, target: Target) -> KernelChoice:
    for gemm_rule in rules("gemm_cuda"):
        picked = gemm_rule(site, target)
        if picked is not None:
            return picked
    raise AssertionError("the last rule always answers")


def switches_to_dense(site: GemmSite, picked: KernelChoice) -> bool:
    """Whether ``picked`` can hand its many-row calls to the dense GEMM (``KernelChoice.dense_from``): a 16-bit
    block-sparse kernel writing 16-bit outputs."""
    return picked.kernel == "bsr_linear" and picked.dtype in ("float16", "bfloat16") and not picked.dense_grid \
        and not site.requantized


def dequantises(site: GemmSite, picked: KernelChoice) -> bool:
    """Whether ``picked`` can run its many-row calls on the dense GEMM over its W4A16 GEMVs' codes dequantised at
    each call (``KernelChoice.dequant``): a W4A16 tile of any M with those GEMVs, writing 16-bit outputs."""
    return picked.kernel == "bsr_linear" and picked.dtype == "w4a16" and site.any_rows and not site.requantized \
        and any(family == "w4a16_gemv" for _, family, _ in picked.few_rows or ())


def select_kernels(graph: Graph, plan: Plan, target: Target) -> Plan:
    """Choose the kernel of every GEMM the plan runs on sparta (``kind="sparse"``) and of the attention ops
    ``select_attention`` takes, in place; returns the plan."""
    from ..templates.bsr_linear.select import gates
    for op_plan in plan.ops.values():
        if op_plan.kind != "sparse" or op_plan.kernel is not None and op_plan.kernel.kernel == "conv2d":
            continue
        op = graph.op(op_plan.op)
        site = gemm_site(graph, op, op_plan, plan)
        op_plan.kernel = choice("torch", "not_a_gemm", f"not a GEMM the CUDA template takes ({op.op})") \
            if site is None else select_gemm(site, target)
        if site is not None:           # each bucket of rows priced by the kernel that runs there
            last = max([r for r, _, _ in op_plan.rows_us], default=site.m)
            widths = dense_widths(graph, op, target.profile)
            if op_plan.dense_from and switches_to_dense(site, op_plan.kernel):
                picked = op_plan.kernel
                picked.dense_from = dense_switch_rows(site, picked, target.profile, last, widths)
                if picked.dense_from and picked.buckets:     # no tile kernel for rows the dense GEMM takes
                    low = [0] + [top for top, _ in picked.buckets]
                    picked.buckets = [b for b, lo in zip(picked.buckets, low) if lo + 1 < picked.dense_from] or None
            elif dequantises(site, op_plan.kernel):
                picked = op_plan.kernel
                picked.dense_from = dense_switch_rows(site, picked, target.profile, last, widths,
                                                      dequant_us(site, picked, target.profile))
                picked.dequant = picked.dense_from is not None
            elif op_plan.dense_from:
                op_plan.kernel.note = "; ".join(n for n in (op_plan.kernel.note, "the plan's dense GEMM for many rows "
                                                "does not run: this kernel takes every call") if n)
            op_plan.kernel.bucket_us = bucket_estimates(site, op_plan.kernel, target.profile, last, widths)
        fuses = epilogue_of(op_plan.kernel.kernel)
        for _, family, _ in op_plan.kernel.few_rows or ():    # every kernel of the op computes the fused epilogue
            less = epilogue_of(family)
            if less is not None:
                fuses = less if fuses is None else tuple(e for e in fuses if e in less)
        if fuses is not None:          # the rest of the planned epilogue runs as torch ops after the kernel
            op_plan.epilogue = [e for e in op_plan.epilogue if e in fuses]
        if not gates(op_plan.kernel):  # the gated unit runs as torch ops (slices, activation, product)
            op_plan.epilogue = [e for e in op_plan.epilogue if not is_gated(e)]
        elif (unit := fused_gate(graph, op, op_plan)) is not None:
            for o in unit.ops:
                plan.ops[o.name].est_us = 0.0
                plan.ops[o.name].note = f"computed by {op.name}'s epilogue ({op_plan.epilogue[-1]})"
    select_convolutions(graph, plan, target)      # the pruned convolutions the conv2d kernel takes
    fuse(graph, plan, target)
    return select_attention(graph, plan)


__all__ = ["GemmSite", "GEMM_OPS", "ROW_BUCKETS", "choice", "select_gemm", "select_kernels", "gemm_site"]
