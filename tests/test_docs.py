"""The docs stay true: the README is short, and what README.md and docs/architecture.md cite in backticks — repository
paths, Python names — exists."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/architecture.md")
PACKAGES = {"sparta": "sparta", "passes": "passes", "codegen": "codegen", "templates": "templates"}
NOT_PATHS = ("split_k.py",)          # the walk-through's hypothetical variant


def cited(doc: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", (ROOT / doc).read_text())


def test_readme_is_at_most_60_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 60


def _path_like(text: str) -> bool:
    return "/" in text and re.fullmatch(r"[\w./<>{},*-]+", text) is not None and not text.startswith(("http", "sparta::"))


def _expand(text: str) -> list[str]:
    """``templates/<family>/runtime.py`` → every family's; ``codegen/select_{cpu,cuda}.py`` → both."""
    if "{" in text:
        head, alts, tail = re.match(r"(.*)\{(.*)\}(.*)", text).groups()
        return [p for a in alts.split(",") for p in _expand(head + a + tail)]
    if "<family>" in text:
        return [text.replace("<family>", d.name) for d in (ROOT / "templates").iterdir() if (d / "__init__.py").is_file()]
    if "<" in text or "*" in text:     # a pattern (profiles/<target>.json): its folder exists
        return [text.split("<")[0].split("*")[0].rsplit("/", 1)[0] or "."]
    return [text]


@pytest.mark.parametrize("doc", DOCS)
def test_cited_paths_exist(doc):
    missing = []
    for text in cited(doc):
        if not _path_like(text) or text.endswith(NOT_PATHS):
            continue
        for path in _expand(text.split(":")[0].rstrip("/")):
            if not (ROOT / path).exists() and not (ROOT / "benchmarks" / path).exists() and not _module_attr(path):
                missing.append(path)
    assert not missing, f"{doc} cites paths that do not exist: {missing}"


def _module_attr(text: str) -> bool:
    """``passes/simplify.fuse_sibling_linears``: a module's file and a name in it."""
    path, _, attr = text.rpartition(".")
    if not path or not (ROOT / f"{path}.py").is_file():
        return False
    top, *rest = path.split("/")
    module = ".".join((["sparta"] if top != "sparta" else []) + [top, *rest])
    return _resolve(f"{module}.{attr}")


def _resolve(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            if attr in fields:
                obj = fields[attr]
                continue
            if not hasattr(obj, attr):
                # an instance attribute a class sets in its methods (``Graph.meta``)
                return isinstance(obj, type) and re.search(rf"self\.{attr}\s*[:=]", inspect.getsource(obj)) is not None
            obj = getattr(obj, attr)
        return True
    return False


CLASSES = {"OpPlan": "sparta.passes.transform.plan", "KernelChoice": "sparta.passes.transform.plan",
           "Plan": "sparta.passes.transform.plan", "SubOp": "sparta.passes.transform.plan",
           "Graph": "sparta.graph", "graph": "sparta.graph.Graph", "CompiledModel": "sparta.compiled_model",
           "compiled": "sparta.compiled_model.CompiledModel", "FusionGroup": "sparta.passes.transform.groups",
           "KernelFamily": "sparta.templates.registry", "Target": "sparta.target", "BsrSpec":
           "sparta.templates.bsr_linear.spec", "CompileContext": "sparta.pipeline", "CompileOptions": "sparta.pipeline",
           "QuantReport": "sparta.passes.quant.report", "GemmSite": "sparta.codegen.select_cuda",
           "torch_export": "sparta.frontend.torch_export"}
PREFIXED = ("passes", "codegen", "templates")       # sparta.passes, ... (pyproject's package-dir)
NOT_NAMES = ("spec.name", "choice.tiles",           # variables of the walk-through's code
             "bsr_gemv.max_rows")                   # a key of passes/profiles/cuda_kernels.json


def test_cited_python_names_resolve():
    bad = []
    for text in cited("docs/architecture.md"):
        name = text.split("(")[0].rstrip(":")
        if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+", name) or name in NOT_NAMES \
                or name.endswith((".py", ".json", ".md", ".toml", ".so")):
            continue
        head, _, rest = name.partition(".")
        if head in ("sparta", "torch"):
            ok = _resolve(name)
        elif head in PREFIXED:
            ok = _resolve(f"sparta.{name}")
        elif head in CLASSES:
            ok = _resolve(f"{CLASSES[head]}.{name}" if head[0].isupper() else f"{CLASSES[head]}.{rest}")
        else:
            ok = False
        if not ok:
            bad.append(name)
    assert not bad, f"docs/architecture.md names what does not exist: {bad}"
