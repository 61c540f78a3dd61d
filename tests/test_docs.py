"""The docs stay true: the README is short, what README.md and docs/architecture.md cite in backticks — repository
paths, Python names — exists, and so do the files each kernel family's README names."""

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/architecture.md")
NOT_PATHS = ("split_k.py",)          # the walk-through's hypothetical variant


def cited(doc: str) -> list[str]:
    """The inline code spans of ``doc`` (one may wrap a line), fenced blocks left out."""
    text = re.sub(r"^```.*?^```", "", (ROOT / doc).read_text(), flags=re.MULTILINE | re.DOTALL)
    return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", text)]


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


PREFIXED = ("passes", "codegen", "templates")       # sparta.passes, ... (pyproject's package-dir)
NOT_NAMES = ("spec.name", "choice.tiles",           # variables of the walk-through's code
             "bsr_gemv.max_rows")                   # a key of passes/profiles/cuda_kernels.json


def _classes() -> dict[str, str]:
    """Every class the packages define → its module (``OpPlan`` → ``sparta.passes.transform.plan``)."""
    found = {}
    for top in ("sparta", *PREFIXED):
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = [p for p in f.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
            module = ".".join((["sparta"] if top != "sparta" else []) + parts)
            for name in re.findall(r"^class (\w+)", f.read_text(), re.MULTILINE):
                found.setdefault(name, module)
    return found


INSTANCES = {"graph": "sparta.graph.Graph", "compiled": "sparta.compiled_model.CompiledModel",   # prose's objects
             "torch_export": "sparta.frontend.torch_export"}


@pytest.mark.parametrize("doc", DOCS)
def test_cited_python_names_resolve(doc):
    """``sparta.pipeline.PASSES``, ``OpPlan.kernel``, ``codegen.profile.host_profile``, ``torch.export.Dim.AUTO``,
    a bare class name (``GemmSite``): each resolves. Other spans (rule names, keys, shell lines) are prose here."""
    classes, bad = _classes(), []
    for text in cited(doc):
        name = text.split("(")[0].rstrip(":")
        if re.fullmatch(r"[A-Z]\w*[a-z]\w*", name):            # a bare class name
            if name not in classes:
                bad.append(name)
            continue
        if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+", name) or name in NOT_NAMES \
                or name.endswith((".py", ".json", ".md", ".toml", ".so")):
            continue
        head, _, rest = name.partition(".")
        if head in ("sparta", "torch"):
            ok = _resolve(name)
        elif head in PREFIXED:
            ok = _resolve(f"sparta.{name}")
        elif head in classes:
            ok = _resolve(f"{classes[head]}.{name}")
        elif head in INSTANCES:
            ok = _resolve(f"{INSTANCES[head]}.{rest}")
        else:
            ok = False
        if not ok:
            bad.append(name)
    assert not bad, f"{doc} names what does not exist: {bad}"


FAMILIES = sorted(d for d in (ROOT / "templates").iterdir() if (d / "__init__.py").is_file())


@pytest.mark.parametrize("folder", FAMILIES, ids=lambda d: d.name)
def test_family_readme_cites_files_that_exist(folder):
    """Each kernel family has a README, and the files it names (``kernel.py``, ``bsr_linear/gemv.py``,
    ``templates/ptx.py``) exist: in the family's folder, under ``templates/`` or from the repository root."""
    readme = folder / "README.md"
    assert readme.is_file(), f"{folder.name} has no README.md"
    bases = (folder, ROOT / "templates", ROOT, ROOT / "benchmarks")
    missing = [text for text in cited(readme.relative_to(ROOT).as_posix())
               if re.fullmatch(r"[\w./-]+\.(py|json|md)", text) and not any((b / text).exists() for b in bases)]
    assert not missing, f"{readme.relative_to(ROOT)} cites files that do not exist: {missing}"
