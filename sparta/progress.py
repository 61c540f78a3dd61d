"""Progress bars of a compile's stages (tqdm, on stderr): shown when stderr is a terminal, never with
``SPARTA_PROGRESS=0``, always with ``SPARTA_PROGRESS=1``."""

from __future__ import annotations

import os
import sys


def enabled() -> bool:
    flag = os.environ.get("SPARTA_PROGRESS", "")
    if flag in ("0", "1"):
        return flag == "1"
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def bar(desc: str, total: int | None = None, unit: str = "op"):
    """A tqdm bar for one stage (a disabled one when :func:`enabled` is false): ``update(n)``, ``close()``, and a
    context manager."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled(), leave=False,
                dynamic_ncols=True)


__all__ = ["bar", "enabled"]
