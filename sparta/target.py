"""``Target``: one object per device that the planner and codegen both read.

A target is its cost model (the measured :class:`~sparta.passes.transform.HardwareProfile`,
``passes/profiles/<name>.json``) and, where sparta picks among kernel tilings, the measured tile
tables (``passes/profiles/<name>_kernels.json``, with the device, date and command that measured
them). Nothing else in the code holds a device's numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .errors import PlanError

TARGETS = ("cpu", "cuda")


@dataclass(frozen=True)
class Target:
    name: str                       # "cpu" | "cuda"
    profile: object                 # HardwareProfile: what the target runs and what it costs
    kernels: dict = field(default_factory=dict)   # measured tile tables (empty where nothing is chosen)

    @property
    def device(self) -> str:
        return self.profile.device

    @property
    def sms(self) -> int:
        """Streaming multiprocessors of the GPU the tile tables were measured on."""
        if "sms" not in self.kernels:
            raise PlanError(f"target {self.name!r} has no SM count")
        return int(self.kernels["sms"])

    def tiles(self, table: str, key=None):
        """One measured tile table (``key``: one entry of it), as a fresh dict."""
        if table not in self.kernels:
            raise PlanError(f"target {self.name!r} ({self.device}) has no measured {table!r} tiles")
        entry = self.kernels[table] if key is None else self.kernels[table][str(key)]
        return json.loads(json.dumps(entry))


def load_target(target="cpu", profile=None) -> Target:
    """The target ``"cpu"``/``"cuda"`` (or a :class:`Target`), its cost model replaced by ``profile``
    (a profile JSON path or a HardwareProfile) if given."""
    from .passes.transform.profile import load_profile
    if isinstance(target, Target):
        return target if profile is None else \
            Target(target.name, runnable(load_profile(profile), target.kernels.get("block_shapes")), target.kernels)
    if target not in TARGETS:
        raise PlanError(f"unknown target {target!r}; expected one of {TARGETS}")
    tables = _kernel_tables(target)
    return Target(target, runnable(load_profile(profile or target), tables.get("block_shapes")), tables)


def runnable(profile, shapes):
    """``profile`` with only the block shapes the target's kernels run (all where ``shapes`` is None): a plan then
    holds no cover that codegen would have to run as another."""
    if shapes is None:
        return profile
    keep = {tuple(int(x) for x in s.split("x")) for s in shapes}
    kernels = tuple(dataclasses.replace(k, blocks={b: c for b, c in k.blocks.items() if b in keep})
                    for k in profile.kernels)
    return dataclasses.replace(profile, kernels=kernels)


@functools.lru_cache(maxsize=None)
def _kernel_tables(name: str) -> dict:
    path = resources.files("sparta.passes").joinpath("profiles", f"{name}_kernels.json")
    return json.loads(path.read_text()) if Path(str(path)).is_file() else {}


__all__ = ["Target", "load_target", "runnable", "TARGETS"]
