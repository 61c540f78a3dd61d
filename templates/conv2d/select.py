"""Which convolutions the conv2d family takes on CUDA: the rule table ``conv_cuda`` (a site: ``codegen/select_conv``).

The guards send to torch what the kernel cannot run (groups, channels not a multiple of 8, a dtype other than fp16
or bf16, a bias that is not a constant vector); ``block_sparse_conv`` takes a convolution whose kept blocks make the
kernel cheaper than the vendor's dense convolution by the cost model (``passes/transform/conv_cost.py``).
"""

from __future__ import annotations

from ...passes.transform.conv_cost import block_sparse_conv_us
from ...passes.transform.plan import KernelChoice
from ...passes.transform.transform_op import TIE_MARGIN
from ..registry import rule

TILES = dict(bn=64, bk=32, tm=128, warps_m=4, warps_n=1, stages=3)
# the kernel's throughput per kept block against cuDNN's dense convolution, until a target measures its own (a
# ``conv2d`` table with ``efficiency``, from benchmarks/bench_cuda_conv2d.py): an assumption, said in the plan's note
ASSUMED_EFFICIENCY = 0.6


def _choice(kernel: str, rule_name: str, reason: str, dtype: str = "float16", tiles: dict | None = None,
            note: str = "") -> KernelChoice:
    return KernelChoice(kernel, rule_name, reason, dtype, dict(tiles or {}), None, note)


@rule("conv_cuda", 0)
def conv_shape(site, target):
    if site.groups != 1:
        return _choice("torch", "conv_shape", f"groups={site.groups}: the conv2d kernel takes groups=1")
    if site.cin % 8:
        return _choice("torch", "conv_shape", f"Cin={site.cin} is not a multiple of 8")
    if site.dtype not in ("float16", "bfloat16"):
        return _choice("torch", "conv_shape", f"{site.dtype} activations: the conv2d kernel runs fp16 and bf16")
    if site.bias == "other":
        return _choice("torch", "conv_shape", "bias is not a constant vector")
    return None


@rule("conv_cuda", 90)
def block_sparse_conv(site, target):
    tiles = target.tiles("conv2d") if "conv2d" in getattr(target, "kernels", {}) else {}
    efficiency = float(tiles.pop("efficiency", ASSUMED_EFFICIENCY))
    tiles = {**TILES, **tiles}
    kept, total = site.kept_blocks(tiles["bn"], tiles["bk"]), site.all_blocks(tiles["bn"], tiles["bk"])
    us = block_sparse_conv_us(site.dense_us, kept, total, efficiency, target.profile)
    note = "" if "conv2d" in getattr(target, "kernels", {}) else \
        f"estimate assumes the kernel runs a kept block at {ASSUMED_EFFICIENCY:.0%} of cuDNN's rate (unmeasured)"
    if us < site.dense_us * (1 - TIE_MARGIN):
        site.est_us = us
        return _choice("conv2d", "block_sparse_conv", f"{kept}/{total} blocks of {tiles['bn']}x{tiles['bk']} kept: "
                       f"~{us:.1f} µs against cuDNN's ~{site.dense_us:.1f} µs", site.dtype, tiles, note)
    return _choice("torch", "block_sparse_conv", f"{kept}/{total} blocks kept: ~{us:.1f} µs is not below cuDNN's "
                   f"~{site.dense_us:.1f} µs", site.dtype, note=note)
