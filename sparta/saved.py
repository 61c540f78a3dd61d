"""``compiled.save(dir)`` and ``sparta.load(dir)``: a compiled model on disk, never pickled.

A saved model is a folder::

    sparta.json          manifest: format, versions, target, graph (JSON), plan, kernel report,
                         each kernel module's type and config, and the SHA-256 of every file
    tensors.safetensors  weights (``graph/<name>``) and kernel modules' packed tensors
                         (``module/<op>/<name>``); a weight only a kernel reads is not
                         stored twice: its module's packed copy restores it on load
    kernels/<key>/       each kernel's artifact folder (CUDA: source, cubins, launch.json)

Loading checks every file's hash before reading it, resolves op targets from an
allowlist (``sparta.graph_json``) and rebuilds kernel modules only of the types in
:data:`MODULE_TYPES`. A CUDA model loads without TVM; a CPU model's kernels are TVM
libraries, so loading it needs TVM's runtime.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from .codegen.cache import file_digest
from .errors import SpartaError

MANIFEST, TENSORS, FORMAT = "sparta.json", "tensors.safetensors", "sparta-saved"
VERSION = 4   # 2: a kernel module's reference weight may be rebuilt from its packed weights (reference_dtype);
#               3: W4A16 GEMV specs may split K over CTAs (ksplit); LayerNorms may fuse a residual add;
#               4: W8A8 GEMV modules (w8a8_gemv_cuda)
MODULE_TYPES = {  # saved type name → "module:Class" with saved_state() / from_saved()
    "passthrough": "sparta.backend.fx:Passthrough",
    "fused": "sparta.backend.fx:Fused",
    "bsr_linear_cuda": "sparta.runtime.bsr_linear:SparseLinearCUDA",
    "w4a16_gemv_cuda": "sparta.runtime.w4a16_gemv:W4A16GemvCUDA",
    "w8a8_gemv_cuda": "sparta.runtime.w8a8_gemv:W8A8GemvCUDA",
    "layer_norm_cuda": "sparta.runtime.layernorm:LayerNormCUDA",
    "sparse_linear_cpu": "sparta.codegen.cpu_modules:SparseLinearCPU",
}


class SavedModelError(SpartaError):
    """A saved model that cannot be written or read (missing, altered, or from a newer sparta)."""


def _module_type(module) -> str:
    for name, ref in MODULE_TYPES.items():
        mod_name, cls_name = ref.split(":")
        if type(module).__name__ == cls_name and type(module).__module__ == mod_name:
            return name
    raise SavedModelError(f"cannot save a kernel module of type {type(module).__qualname__}")


def _module_class(name: str):
    if name not in MODULE_TYPES:
        raise SavedModelError(f"saved model uses kernel module type {name!r}, which this sparta does not know")
    mod_name, cls_name = MODULE_TYPES[name].split(":")
    try:
        return getattr(importlib.import_module(mod_name), cls_name)
    except ImportError as exc:
        raise SavedModelError(f"kernel modules of type {name!r} need {exc.name!r}, which is not installed") from exc


def save(compiled, path) -> Path:
    """Write ``compiled`` to the folder ``path`` (replaced if it holds an earlier save)."""
    from safetensors.torch import save_file

    from . import __version__
    from .graph_json import graph_to_json

    dest = Path(path)
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not (dest / MANIFEST).is_file())):
        raise SavedModelError(f"{dest} exists and is not a saved sparta model; choose an empty or new folder")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "kernels").mkdir(parents=True)
    try:
        graph_json, tensors = graph_to_json(compiled.graph)
        restorable = _restorable_weights(compiled)
        for name in restorable:                       # the kernel module's packed copy restores it
            del tensors["graph/" + name]
        modules = {}
        for op_name, module in compiled.module_replacements().items():
            config, mtensors, folders = module.saved_state()
            entry = {"type": _module_type(module), "config": config, "tensors": sorted(mtensors),
                     "kernels": sorted(folders)}
            tensors.update({f"module/{op_name}/{k}": v for k, v in mtensors.items()})
            if getattr(module, "weight_name", None) in restorable:
                entry["restores"] = module.weight_name
            ref = getattr(module, "reference_weight", None)
            if ref is not None:
                entry["weight_name"] = module.weight_name
                if _derivable(module, ref):                # the packed weights give it back: not stored twice
                    entry["reference_dtype"] = str(ref.dtype).split(".")[-1]
                else:
                    tensors[f"module/{op_name}/reference_weight"] = ref
            for key, folder in folders.items():
                _copy_kernel(Path(folder), tmp / "kernels" / key)
            modules[op_name] = entry
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(tmp / TENSORS))
        files = {str(p.relative_to(tmp)): file_digest(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        kernels = [{k: v for k, v in row.items() if k != "artifact"} for row in compiled.kernels]
        manifest = {"format": FORMAT, "version": VERSION, "sparta": __version__, "torch": torch.__version__,
                    "target": compiled.target, "graph": graph_json,
                    "plan": compiled.plan.to_json() if compiled.plan is not None else None,
                    "kernels": kernels, "timings": compiled.timings, "modules": modules, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def _restorable_weights(compiled) -> set[str]:
    """Weights only kernel modules read, each module able to give it back (``graph_weight()``)."""
    replaced = compiled.module_replacements()
    read = {t for op in compiled.graph.ops() if op.name not in replaced for t in op.inputs}
    read |= set(compiled.graph.outputs)
    return {m.weight_name for m in replaced.values()
            if hasattr(m, "graph_weight") and m.weight_name is not None and m.weight_name not in read}


def _derivable(module, ref: torch.Tensor) -> bool:
    """Whether a kernel module's reference weight is exactly its own ``graph_weight()`` in ``ref``'s dtype."""
    return hasattr(module, "graph_weight") and torch.equal(module.graph_weight().to(ref.dtype), ref.cpu())


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SavedModelError(f"saved model names an unknown dtype {name!r}")
    return dtype


def _copy_kernel(src: Path, dest: Path) -> None:
    if not src.is_dir():
        raise SavedModelError(f"kernel folder {src} is gone (cache cleared?); recompile before saving")
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)


def read_manifest(path) -> dict:
    """The manifest of a saved model, after checking the hash of every file it lists."""
    root = Path(path)
    if not (root / MANIFEST).is_file():
        raise SavedModelError(f"{root} is not a saved sparta model (no {MANIFEST})")
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except ValueError as exc:
        raise SavedModelError(f"{root / MANIFEST} is not valid JSON: {exc}") from exc
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("version"), int):
        raise SavedModelError(f"{root} is not a saved sparta model (format {manifest.get('format')!r})")
    if manifest["version"] > VERSION:
        raise SavedModelError(f"{root} was saved by a newer sparta (format version {manifest['version']}); "
                              f"this one reads version {VERSION}")
    for rel, digest in manifest.get("files", {}).items():
        file = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise SavedModelError(f"saved model lists a file outside its folder: {rel!r}")
        if not file.is_file():
            raise SavedModelError(f"saved model {root} is missing {rel}")
        if file_digest(file) != digest:
            raise SavedModelError(f"saved model {root}: {rel} was altered (SHA-256 mismatch)")
    if TENSORS not in manifest.get("files", {}):
        raise SavedModelError(f"saved model {root} lists no {TENSORS}")
    return manifest


def _load_modules(root: Path, manifest: dict, tensors: dict) -> dict:
    replacements = {}
    for op_name, entry in manifest["modules"].items():
        cls = _module_class(entry["type"])
        prefix = f"module/{op_name}/"
        mtensors = {k: tensors[prefix + k] for k in entry["tensors"]}
        if any(not str(key).isalnum() for key in entry["kernels"]):
            raise SavedModelError(f"saved model {root}: kernel folder names must be plain keys")
        folders = {key: root / "kernels" / key for key in entry["kernels"]}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            module = cls.from_saved(entry["config"], mtensors, folders)
        rebuilt = module.graph_weight() if "reference_dtype" in entry or "restores" in entry else None
        if "weight_name" in entry:
            module.weight_name = entry["weight_name"]
            if "reference_dtype" in entry:
                module.reference_weight = rebuilt.to(_dtype(entry["reference_dtype"]), copy=True)
            else:
                module.reference_weight = tensors[prefix + "reference_weight"]
        if "restores" in entry:
            tensors["graph/" + entry["restores"]] = rebuilt
        replacements[op_name] = module
    return replacements


def load(path):
    """Load a model written by ``compiled.save(path)``; CUDA models need no TVM."""
    from safetensors.torch import load_file

    from .compiler import CompiledModel
    from .graph_json import graph_from_json
    from .passes.transform.plan import Plan

    root = Path(path)
    manifest = read_manifest(root)
    # own, aligned copies: safetensors' mmapped tensors are only 8-byte aligned (TVM's kernels assume 64)
    tensors = {k: v.clone() for k, v in load_file(str(root / TENSORS)).items()}
    try:
        replacements = _load_modules(root, manifest, tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise SavedModelError(f"saved model {root}: malformed kernel module entry ({type(exc).__name__}: {exc})") from exc
    graph = graph_from_json(manifest["graph"], tensors)
    for v in graph.tensors("weight"):                 # restored weights come back in the kernel's fp16
        if v.data is not None and v.data.dtype != v.dtype:
            v.data = v.data.to(v.dtype)
    plan = Plan.from_json(manifest["plan"]) if manifest.get("plan") is not None else None
    kernels = [dict(row) for row in manifest.get("kernels", [])]
    return CompiledModel(graph, target=manifest["target"], plan=plan, replacements=replacements,
                         timings=manifest.get("timings"), kernels=kernels)


__all__ = ["save", "load", "read_manifest", "SavedModelError", "MODULE_TYPES"]
