"""What every CUDA family's ``build`` shares: the parts of a planned GEMM it reads (:func:`gemm_parts`), binding a
kernel module to the graph weight it stands for, and the kernel report's rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graph import Graph, Op
from ..passes.fusion import fused_activation, fused_gate
from ..passes.transform.plan import OpPlan
from ..passes.transform.transform_op import gemm_bias, gemm_view
from .select_cuda import GemmSite, gemm_site


@dataclass
class GemmParts:
    """A planned GEMM as a family's build reads it."""

    view: tuple                    # gemm_view: (x name, weight name, transposed, m, n, k)
    site: GemmSite                 # what selection read
    rows: int                      # the kernel's M (0: any number of rows)
    bias: torch.Tensor | None      # the kept bias, fp32
    fused: Op | None               # the activation op the epilogue computes
    unit: object                   # the gated unit the epilogue computes (GatedUnit) or None

    @property
    def x_name(self) -> str:
        return self.view[0]

    @property
    def n(self) -> int:
        return self.view[4]

    @property
    def k(self) -> int:
        return self.view[5]

    @property
    def act(self) -> str:
        """The activation a kernel without a gated epilogue applies ("none" where the plan fuses none, or a gate)."""
        return self.site.act if self.fused is not None and not self.site.gate else "none"

    def output(self, op: Op) -> str:
        """The graph tensor the kernel writes: the fused activation's output, else ``op``'s."""
        return (self.fused if self.act != "none" else op).outputs[0]


def gemm_parts(graph: Graph, op: Op, op_plan: OpPlan) -> GemmParts:
    view = gemm_view(graph, op)
    site = gemm_site(graph, op, op_plan)
    name = gemm_bias(op)
    bias = graph.tesa(name).apply(graph.tensor(name).data.float()) if name else None
    return GemmParts(view, site, 0 if site.any_rows else view[3], bias, fused_activation(graph, op, op_plan),
                     fused_gate(graph, op, op_plan))


def bind(module, graph: Graph, op: Op, view, reference: bool) -> None:
    """Record the graph weight the module stands for (and, for quantised kernels, that the dense reference applies
    the weight the kernel applies: rebuilt from the packed weights in the graph weight's dtype when read,
    ``sparta.compiled_model.reference_weight``)."""
    module.weight_name, module.weight_transposed = view[1], op.op in ("addmm", "mm", "matmul")
    if reference:
        module.reference_dtype = graph.tensor(view[1]).dtype


def torch_row(op: Op, bits: str, why: str) -> dict:
    """The kernel report row of an op left to torch, ``why`` in its key column."""
    return {"op": op.name, "template": "torch", "blocks": "-", "bits": bits, "dismantle": "-",
            "build_s": 0.0, "cached": False, "code_bytes": 0, "key": why}


def report_row(op: Op, template: str, blocks: str, bits: str, dismantle: str, arts: list) -> dict:
    """The kernel report row of an op built from ``arts`` (the first is the kernel it runs by default)."""
    art = arts[0]
    return {"op": op.name, "template": template, "blocks": blocks, "bits": bits, "dismantle": dismantle,
            "build_s": round(art.build_s, 3), "cached": art.cached,
            "code_bytes": sum((a.path / c["file"]).stat().st_size for a in arts for c in a.launch["cubins"].values()),
            "key": art.path.name, "artifact": str(art.path)}
