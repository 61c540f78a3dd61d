"""Bit rounding: round every kept element's bits up to a width the hardware runs, and
enumerate how to group the widths into sub-TeSAs.

With supported widths present in a tensor ``w1 < w2 < … < wk``, a grouping is a split of
that sorted list into consecutive runs; each run becomes one sub-TeSA at its widest width
(the run ``{4, 8}`` stores 4-bit elements at 8 bits). ``k`` widths give ``2^(k-1)``
options, among them "one sub-TeSA per width" and "everything at the widest width".
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass

import torch

from ...errors import ArgumentTypeError, GraphError, PlanError
from ...formats import default_format, get_format
from .fp8 import FP8_FORMAT
from ...tesa import TeSA, bits_of_dtype
from ..gemm import gemm_view


@dataclass(frozen=True)
class BitGroup:
    bits: int              # the width this group runs at
    tesa: TeSA             # kept elements of the group, at ``bits``


def round_bits(tesa: TeSA, widths: list[int]) -> TeSA:
    """Each kept element's bits rounded up to the smallest width in ``widths`` holding it (on a TeSA's blocks where
    it is held by blocks)."""
    widths = sorted(widths)

    def rounded(view):
        bits = view.to(torch.int16)
        out = torch.zeros_like(bits)
        lower = 0
        for w in widths:
            out = torch.where((bits > lower) & (bits <= w), torch.full_like(bits, w), out)
            lower = w
        return torch.where(bits > widths[-1], torch.full_like(bits, widths[-1]), out)
    return tesa.map_bits(rounded)


def groupings(tesa: TeSA, widths: list[int]) -> list[list[BitGroup]]:
    """Every way to group the rounded widths into sub-TeSAs (finest first, widest last)."""
    rounded = round_bits(tesa, widths)
    present = sorted(b for b in rounded.bit_histogram() if b)
    if not present:
        return [[]]
    options = []
    for cuts in itertools.product([False, True], repeat=len(present) - 1):
        runs, run = [], [present[0]]
        for w, cut in zip(present[1:], cuts):
            if cut:
                runs.append(run)
                run = [w]
            else:
                run.append(w)
        runs.append(run)
        groups = []
        for lo, hi in ((r[0], r[-1]) for r in runs):
            sel = rounded.map_bits(lambda bits: torch.where((bits >= lo) & (bits <= hi), hi, 0))
            groups.append(BitGroup(hi, sel))
        options.append(groups)
    options.sort(key=len, reverse=True)
    return options


# ---- number formats: what each sub-operator's bits mean -------------------------------------------------------
def choose_formats(graph, plan, target, formats=None):
    """Give every sub-operator of ``plan`` its weight and activation :mod:`~sparta.formats` format, in place.

    By default a width's usual format: int4 / int8, bf16 for 16 bits of a bfloat16 tensor else fp16, fp32.
    ``formats`` asks otherwise: a format name for every weight of its width (``"fp8_e4m3"``), or a dict of weight
    (parameter or tensor) names to format names (``{"fc1.weight": "fp8_e4m3"}``). An asked format must be one the
    ``target`` runs for weights and (named weights) have a width the weight's TeSA rounds to; 8-bit activations of
    fp8 weights are fp8 too. Integer scales (``weight_quant``) of widths that no longer run an integer format go.
    Returns ``plan``."""
    every, asked = _asked(graph, target, formats)
    prof = target.profile
    planned = {p.weight for p in plan.ops.values() if p.gemm is not None}
    if stray := [n for w, by in asked.items() if w not in planned for n in by]:
        raise PlanError(f"formats: {', '.join(map(repr, stray))} is not the weight of a GEMM sparta plans")
    for p in plan.ops.values():
        view = gemm_view(graph, graph.op(p.op)) if p.subops and p.weight is not None else None
        if view is None:
            continue
        x, w, wtesa = view[:3]
        wdtype, xdtype = graph.tensor(w).dtype, graph.tensor(x).dtype
        fmt, names = _asked_of(graph, w, asked, every)
        if fmt is not None:         # the widths its TeSA rounds to (as transform_gemm rounds them)
            act_bits = prof.round_up(int(graph.tesa(x).max_bits()) or bits_of_dtype(xdtype), prof.act_widths())
            widths = prof.weight_widths(act_bits)
            present = sorted({b for b in round_bits(wtesa, widths).bit_histogram() if b}
                             | {s.weight_bits for s in p.subops if (s.weight_bits, s.act_bits) == (8, 16)})
        if fmt is not None and fmt.bits not in present:
            if names and fmt.bits in wtesa.bit_histogram():
                raise PlanError(f"formats[{names[0]!r}]: {w}'s {fmt.bits}-bit elements run at "
                                f"W{'/'.join(map(str, present))} on {target.name}: it has no {fmt.name} kernel beside "
                                f"A{act_bits} activations" + ("; ask for fp8_e4m3" if fmt.bits == 8 and act_bits == 16
                                                              and "fp8_gemv" in prof.low_bit_gemv else ""))
            if names:
                raise PlanError(f"formats[{names[0]!r}]: {fmt.name} is {fmt.bits}-bit, but {w}'s TeSA bits round to "
                                f"{'/'.join(map(str, present)) or 'none (all pruned)'} on {target.name} (weights "
                                f"W{', W'.join(map(str, widths))} with A{act_bits} activations): give its TeSA "
                                f"{fmt.bits}-bit elements or ask for a format of its widths")
            fmt = None              # formats="...": only the weights of its width
        for s in p.subops:          # 8-bit weights beside 16-bit activations: planned as FP8 (transform/fp8.py)
            planned = FP8_FORMAT if (s.weight_bits, s.act_bits) == (8, 16) else None
            if planned and fmt is not None and s.weight_bits == fmt.bits and fmt.kind != "float" and names:
                raise PlanError(f"formats[{names[0]!r}]: {w}'s {s.weight_bits}-bit weights run beside A{s.act_bits} "
                                f"activations on {target.name} as {planned}; it has no {fmt.name} kernel there: ask "
                                f"for {planned} or give the activations {fmt.bits} bits")
            wf = planned if planned and (fmt is None or s.weight_bits != fmt.bits or not names) else \
                fmt.name if fmt is not None and s.weight_bits == fmt.bits else default_format(s.weight_bits, wdtype)
            s.weight_format, s.act_format = wf, _act_format(s.act_bits, wf, xdtype, target)
        if fmt is not None and not any(s.weight_format == fmt.name for s in p.subops):
            why = f"{fmt.name} asked for {w}: the plan runs it at " + \
                ", ".join(sorted({f"W{s.weight_bits}A{s.act_bits}" for s in p.subops})) + f", not at {fmt.bits} bits"
            p.note = f"{p.note}; {why}" if p.note else why
        ints = {s.weight_bits for s in p.subops if get_format(s.weight_format).kind == "int"}
        p.weight_quant = {b: q for b, q in p.weight_quant.items() if b in ints}
    return plan


def asked_fp8(graph, target, formats) -> set[str]:
    """The weight tensors ``formats`` asks to be FP8 (E4M3): a weight of every width or by name."""
    every, asked = _asked(graph, target, formats)
    if every is not None:
        return {v.name for v in graph.tensors("weight")} if every.name == "fp8_e4m3" else set()
    return {w for w, by in asked.items() if any(f.name == "fp8_e4m3" for f in by.values())}


def check_formats(formats) -> None:
    """Raise where ``formats`` (``compile``'s argument) is not None, a format name or a dict of names to names."""
    from collections.abc import Mapping
    if formats is None:
        return
    if isinstance(formats, str):
        get_format(formats)
        return
    if not isinstance(formats, Mapping):
        raise ArgumentTypeError(f"formats must be a format name (e.g. 'fp8_e4m3') or a dict of weight names to "
                                f"format names, got {type(formats).__name__}")
    for name, value in formats.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"formats keys must be weight names (str), got {name!r}")
        get_format(value)


def _asked(graph, target, formats):
    """(the format asked for every weight or None, {weight tensor: {asked name: format}})."""
    check_formats(formats)
    if formats is None:
        return None, {}
    if isinstance(formats, str):
        return _runs(get_format(formats), target, "formats"), {}
    parts = {part: stacked for stacked, rows in graph.stacked_weights.items() for part, _, _ in rows}
    asked = {}
    for name, value in formats.items():
        fmt = _runs(get_format(value), target, f"formats[{name!r}]")
        try:
            tensor = parts.get(name) or graph.resolve(name)[0]
        except GraphError:
            known = [v.name for v in graph.tensors("weight")] + list(parts)
            close = difflib.get_close_matches(name, known, n=3)
            raise PlanError(f"formats: unknown weight {name!r}" +
                            (f"; did you mean {', '.join(map(repr, close))}?" if close else "")) from None
        asked.setdefault(tensor, {})[name] = fmt
    return None, asked


def _asked_of(graph, w: str, asked: dict, every):
    """(the format asked for weight ``w``, the names it was asked by); linears stacked as one take one format."""
    mine = asked.get(w, {})
    rows = graph.stacked_weights.get(w)
    if rows is None:
        if len({f.name for f in mine.values()}) > 1:
            raise PlanError(f"formats: {', '.join(mine)} name one weight ({w}) and ask different formats")
        return (next(iter(mine.values())), list(mine)) if mine else (every, [])
    per_part = {part: mine.get(part, every) for part, _, _ in rows}
    names = {part: f.name if f is not None else "default" for part, f in per_part.items()}
    if len(set(names.values())) > 1:
        raise PlanError(f"formats: {', '.join(per_part)} run stacked as one linear ({w}); ask one format for all "
                        f"(asked: {', '.join(f'{k}={v}' for k, v in names.items())})")
    fmt = next(iter(per_part.values()))
    return fmt, list(mine)


def _runs(fmt, target, what: str):
    runs = target.runs("weight")
    if fmt.name not in runs:
        raise PlanError(f"{what}: {target.name} ({target.device}) does not run {fmt.name} weights; it runs "
                        f"{', '.join(runs)}")
    return fmt


def _act_format(bits: int, weight_format: str, dtype, target) -> str:
    """The activations' format beside weights of ``weight_format``: fp8 beside fp8 weights (where the target runs
    it), bf16 beside bf16 weights or for a bfloat16 input, else the width's default."""
    if bits == 8 and weight_format.startswith("fp8") and weight_format in target.runs("act"):
        return weight_format
    if bits == 16 and weight_format == "bf16":
        return "bf16"
    return default_format(bits, dtype)

