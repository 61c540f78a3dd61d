"""``Target``: one object per device that the planner and codegen both read.

A target is its cost model (the measured :class:`~sparta.passes.transform.HardwareProfile`,
``passes/profiles/<name>.json``) and, where sparta picks among kernel tilings, the measured tile
tables (``passes/profiles/<name>_kernels.json``, with the device, date and command that measured
them). Nothing else in the code holds a device's numbers.

It also lists the number formats (:mod:`sparta.formats`) the device runs per role (``"weight"``, ``"act"``): the
profile JSON's ``formats`` (e.g. ``{"weight": ["int4", "int8", "fp8_e4m3", ...], "act": [...]}``), kept to the widths
its kernels run; a profile without them runs the default format of each width (int4, int8, fp16, fp32).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .errors import PlanError
from .formats import default_format, get_format

TARGETS = ("cpu", "cuda")
ROLES = ("weight", "act")


@dataclass(frozen=True)
class Target:
    name: str                       # "cpu" | "cuda"
    profile: object                 # HardwareProfile: what the target runs and what it costs
    kernels: dict = field(default_factory=dict)   # measured tile tables (empty where nothing is chosen)
    formats: dict = field(default_factory=dict)   # role ("weight" | "act") -> format names it runs ({}: defaults)

    @property
    def device(self) -> str:
        return self.profile.device

    @property
    def sms(self) -> int:
        """Streaming multiprocessors of the GPU the tile tables were measured on."""
        if "sms" not in self.kernels:
            raise PlanError(f"target {self.name!r} has no SM count")
        return int(self.kernels["sms"])

    def runs(self, role: str) -> tuple[str, ...]:
        """The number formats the target runs for ``role`` (``"weight"`` or ``"act"``)."""
        if role not in ROLES:
            raise PlanError(f"unknown role {role!r}; expected one of {ROLES}")
        return tuple(self.formats[role]) if role in self.formats else default_formats(self.profile)[role]

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
        if profile is None:
            return target
        prof = load_profile(profile)
        return Target(target.name, runnable(prof, target.kernels.get("block_shapes")), target.kernels,
                      runnable_formats(_profile_formats(profile) or target.formats, prof))
    if target not in TARGETS:
        raise PlanError(f"unknown target {target!r}; expected one of {TARGETS}")
    tables = _kernel_tables(target)
    prof = load_profile(profile or target)
    formats = (_profile_formats(profile) if profile is not None else None) or _profile_formats(target)
    return Target(target, runnable(prof, tables.get("block_shapes")), tables, runnable_formats(formats, prof))


def default_formats(profile) -> dict[str, tuple[str, ...]]:
    """The default format of each width ``profile``'s kernels run, per role."""
    return {"weight": tuple(dict.fromkeys(default_format(k.weight_bits) for k in profile.kernels)),
            "act": tuple(dict.fromkeys(default_format(k.act_bits) for k in profile.kernels))}


def runnable_formats(formats: dict | None, profile) -> dict[str, tuple[str, ...]]:
    """``formats`` (role -> names; None: the defaults) kept to the widths ``profile``'s kernels run per role."""
    if not formats:
        return default_formats(profile)
    widths = {"weight": {k.weight_bits for k in profile.kernels}, "act": {k.act_bits for k in profile.kernels}}
    out = {}
    for role in ROLES:
        names = formats.get(role, default_formats(profile)[role])
        out[role] = tuple(n for n in names if get_format(n).bits in widths[role])
    return out


def _profile_formats(source) -> dict | None:
    """The ``formats`` field of a profile JSON (a target name or a path; None for a HardwareProfile or none)."""
    if isinstance(source, str) and source in TARGETS:
        data = _shipped_json(source)
    elif isinstance(source, (str, Path)) and Path(source).is_file():
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, ValueError):
            return None             # load_profile reports a bad file
    else:
        return None
    formats = data.get("formats") if isinstance(data, dict) else None
    if formats is None:
        return None
    if not isinstance(formats, dict) or set(formats) - set(ROLES):
        raise PlanError(f"profile formats must map {ROLES} to lists of format names, got {formats!r}")
    return {role: tuple(get_format(n).name for n in names) for role, names in formats.items()}


@functools.cache
def _shipped_json(name: str) -> dict:
    from .passes.transform.profile import PROFILE_FILES
    return json.loads(resources.files("sparta.passes").joinpath("profiles", PROFILE_FILES[name]).read_text())


def runnable(profile, shapes):
    """``profile`` with only the block shapes the target's kernels run (all where ``shapes`` is None): a plan then
    holds no cover that codegen would have to run as another."""
    if shapes is None:
        return profile
    keep = {tuple(int(x) for x in s.split("x")) for s in shapes}
    kernels = tuple(dataclasses.replace(k, blocks={b: c for b, c in k.blocks.items() if b in keep})
                    for k in profile.kernels)
    return dataclasses.replace(profile, kernels=kernels)


@functools.cache
def _kernel_tables(name: str) -> dict:
    path = resources.files("sparta.passes").joinpath("profiles", f"{name}_kernels.json")
    return json.loads(path.read_text()) if Path(str(path)).is_file() else {}


__all__ = ["ROLES", "TARGETS", "Target", "default_formats", "load_target", "runnable", "runnable_formats"]
