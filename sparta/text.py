"""Plain-text tables for the reports (plan, propagation, kernels, TeSAs)."""

from __future__ import annotations


def table(rows) -> str:
    """``rows`` (the first is the header) as left-aligned columns with a rule under the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
