"""What calibration decided: one :class:`Decision` per tensor tried, and the report (table, plot, JSON)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...errors import SpartaError

@dataclass
class Decision:
    """One tensor whose bits calibration lowered (or tried to)."""

    tensor: str
    kind: str                          # "weight" | "activation"
    ops: list[str]
    bits_before: int
    bits: int                          # the TeSA width chosen (information kept)
    error: float = 0.0                 # relative output MSE added at ``bits`` (worst op)
    trials: dict[int, float] = field(default_factory=dict)   # width -> added relative MSE
    reverted: bool = False
    runs: str = ""                     # the kernel widths the target runs it at, e.g. "W8A8"
    by: str = ""                       # a weight lowered by the activation decision on this tensor
    scale: float | None = None         # an 8-bit activation at one static scale (else per token at run time)
    static_error: float | None = None  # added relative MSE at the best static scale tried
    density: float = 1.0               # joint plan: the fraction of the weight's blocks kept (prune.py)
    prune_trials: dict[str, float] = field(default_factory=dict)   # "density@bits" -> added relative MSE


@dataclass
class QuantReport:
    decisions: list[Decision]
    model_error: float                 # relative MSE of the outputs (or the metric) after calibration
    tolerance: float
    model_tolerance: float | None
    seconds: float
    weights: dict = field(default_factory=dict)          # weight -> WeightQuant: the fitted integer scales
    static_scales: dict[str, float] = field(default_factory=dict)   # int8 activations at one static scale
    device: str = "cpu"                # where the calibration batches ran

    def lowered(self) -> list[Decision]:
        return [d for d in self.decisions if (d.bits < d.bits_before or d.density < 1) and not d.reverted]

    def table(self) -> str:
        """Markdown: every tensor tried, its bits before → after and the error added."""
        rows = ["| tensor | kind | ops | bits | runs as | added rel. MSE | tried (bits: added rel. MSE) |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for d in self.decisions:
            tried = ", ".join([f"{b}: {e:.2e}" for b, e in sorted(d.trials.items(), reverse=True)]
                              + [f"{key}: {e:.2e}" for key, e in d.prune_trials.items()])
            bits = f"{d.bits_before} → {d.bits}" + (f", {d.density:.0%} of blocks kept" if d.density < 1 else "") + \
                (" (undone)" if d.reverted else "") + \
                (f" (with activation {d.by})" if d.by else "") + \
                (f", static scale {d.scale:.3g}" if d.scale is not None and not d.reverted else "")
            err = "—" if d.by else f"{d.error:.2e}"      # the activation's row holds the error of that step
            rows.append(f"| {d.tensor} | {d.kind} | {', '.join(d.ops)} | {bits} | {d.runs} | {err} | {tried} |")
        return "\n".join(rows)

    def plot(self, path) -> str:
        """Bits chosen (bars) and the error each tensor adds (points, log scale) per layer, as a PNG."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise SpartaError("QuantReport.plot needs matplotlib: pip install matplotlib") from e
        ds = self.decisions
        fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(ds)), 4.0))
        xs = range(len(ds))
        ax.bar(xs, [d.bits for d in ds], color=["tab:blue" if d.kind == "weight" else "tab:orange" for d in ds])
        ax.set_ylabel("bits (blue: weight, orange: activation)")
        ax.set_xticks(list(xs), [d.tensor for d in ds], rotation=90, fontsize=6)
        ax2 = ax.twinx()
        ax2.semilogy(list(xs), [math.nan if d.by else max(d.error, 1e-12) for d in ds], "k.", label="added rel. MSE")
        ax2.axhline(max(self.tolerance, 1e-12), color="r", lw=0.8, ls="--", label="tolerance")
        ax2.set_ylabel("added relative output MSE")
        ax2.legend(loc="upper right", fontsize=7)
        ax.set_title(f"calibrated bits; model relative MSE {self.model_error:.2e}")
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return str(path)

    def to_json(self) -> dict:
        return {"model_error": self.model_error, "tolerance": self.tolerance, "model_tolerance": self.model_tolerance,
                "seconds": self.seconds, "decisions": [vars(d) | {"trials": {str(b): e for b, e in d.trials.items()}}
                                                       for d in self.decisions]}
