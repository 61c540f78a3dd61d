"""The kernel-family registry: one entry per folder of ``sparta.templates`` makes a family known to selection,
codegen, the runtime, save/load and the reports.

A family's ``__init__.py`` calls :func:`register` with a :class:`KernelFamily`. Its parts are named as
``".module:attribute"`` inside the family's package and imported only when asked for, so reading the registry needs
neither TVM nor a GPU. The family's name is its folder, its ``torch.library`` op (``sparta::<name>``), its saved
module type, the kernel name the plan's :class:`~sparta.passes.transform.plan.KernelChoice` carries and what the plan
report prints.

Rules are contributed to named tables (``"gemm"``, ``"norm"``, ...) with an ``order``: a table is every family's
rules for it, sorted by order (TVM dlight's per-target rule lists, assembled from the families).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

from ..errors import SpartaError


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family: its folder ``sparta/templates/<name>/`` and what the rest of sparta reads of it."""

    name: str
    targets: tuple[str, ...]               # where it runs: "cuda", "cpu"
    summary: str                           # one line: what it computes
    module: str = ""                       # ".runtime:Class": its kernel module (a KernelModule; op and saved type)
    templates: dict = field(default_factory=dict)   # {".spec:SpecClass": ".kernel:template"}: what builds each spec
    build: str = ""                        # ".build:function": codegen of one planned op to its kernel module
    epilogue: tuple[str, ...] | None = None  # the epilogue its kernels compute (None: all the plan asks)
    package: str = ""                      # filled by register(): the family's package

    def part(self, ref: str):
        """The attribute ``ref`` (``".module:attribute"``) of the family's package, imported now."""
        module, _, attr = ref.partition(":")
        try:
            return getattr(importlib.import_module(module, self.package), attr)
        except ImportError as exc:
            raise SpartaError(f"kernel family {self.name!r}: {ref} needs {exc.name!r}, which is not installed") \
                from exc

    def module_class(self):
        return self.part(self.module) if self.module else None

    def spec_templates(self) -> dict:
        """Spec class → template function (imports the templates: needs TVM)."""
        return {self.part(spec): self.part(template) for spec, template in self.templates.items()}

    def builder(self) -> Callable:
        return self.part(self.build)


@dataclass(frozen=True)
class Rule:
    table: str
    order: int
    fn: Callable


_FAMILIES: dict[str, KernelFamily] = {}
_RULES: list[Rule] = []
_loaded = False
_rules_loaded = False


def register(family: KernelFamily, package: str) -> KernelFamily:
    """Make ``family`` (declared in the package ``package``) known; a name is registered once."""
    if family.name in _FAMILIES and _FAMILIES[family.name].package != package:
        raise SpartaError(f"kernel family {family.name!r} registered twice ({_FAMILIES[family.name].package}, "
                          f"{package})")
    entry = KernelFamily(**{**family.__dict__, "package": package})
    _FAMILIES[family.name] = entry
    return entry


def rule(table: str, order: int):
    """Decorator: contribute ``fn`` to the rule table ``table`` at ``order`` (lower runs first)."""
    def add(fn):
        if not any(r.fn is fn for r in _RULES):
            _RULES.append(Rule(table, order, fn))
        return fn
    return add


def _load() -> None:
    global _loaded
    if _loaded:
        return
    from .. import templates
    for info in pkgutil.iter_modules(templates.__path__):
        if info.ispkg:
            importlib.import_module(f"{templates.__name__}.{info.name}")
    _loaded = True


def families(target: str | None = None) -> list[KernelFamily]:
    """Every registered family (of ``target`` if given), in name order."""
    _load()
    return [f for _, f in sorted(_FAMILIES.items()) if target is None or target in f.targets]


def family(name: str) -> KernelFamily:
    _load()
    if name not in _FAMILIES:
        raise SpartaError(f"no kernel family {name!r} (known: {', '.join(sorted(_FAMILIES))})")
    return _FAMILIES[name]


def rules(table: str) -> tuple[Callable, ...]:
    """The rule table ``table``: every family's rules for it, by order (each family's ``select`` module imported
    on the first call)."""
    global _rules_loaded
    _load()
    if not _rules_loaded:
        for f in _FAMILIES.values():
            try:
                importlib.import_module(".select", f.package)
            except ModuleNotFoundError as exc:
                if exc.name != f"{f.package}.select":
                    raise
        _rules_loaded = True
    return tuple(r.fn for r in sorted((r for r in _RULES if r.table == table), key=lambda r: r.order))


def module_types() -> dict[str, str]:
    """Saved module type → the family's kernel module reference (``"package.module:Class"``)."""
    out = {}
    for f in families():
        if f.module:
            module, _, attr = f.module.partition(":")
            out[f.name] = f"{importlib.util.resolve_name(module, f.package)}:{attr}"
    return out


def cuda_templates() -> dict:
    """Spec class → template function of every CUDA family (needs TVM)."""
    out = {}
    for f in families("cuda"):
        out.update(f.spec_templates())
    return out


def epilogue_of(kernel: str) -> tuple[str, ...] | None:
    """What the kernels of ``kernel`` compute of an epilogue (None: the plan's whole epilogue; ``"torch"``: none)."""
    if kernel == "torch":
        return ()
    _load()
    found = _FAMILIES.get(kernel)
    return found.epilogue if found is not None else None


__all__ = ["KernelFamily", "register", "rule", "families", "family", "rules", "module_types", "cuda_templates",
           "epilogue_of"]
