"""``compiled.save(dir)`` and ``sparta.load(dir)``: a compiled model on disk, never pickled.

A saved model is a folder::

    sparta.json          manifest: format, versions, target, graph (JSON), plan, kernel report,
                         each kernel module's type and config, and the SHA-256 of every other file
    tensors.safetensors  weights (``graph/<name>``) and kernel modules' packed tensors
                         (``module/<op>/<name>``); a weight only a kernel reads is not
                         stored twice: its module's packed copy restores it on load
    kernels/<key>/       each kernel's artifact folder (CUDA: source, cubins, launch.json; CPU: kernel.so)

A saved model is data: loading checks the folder (``sparta.saved_checks``), resolves op targets
from an allowlist of pure tensor ops (``sparta.graph_json``), rebuilds kernel modules only of the
types in :data:`MODULE_TYPES`, and loads no native code from the folder unless asked to: CPU
kernels are rebuilt from their saved specs by sparta's own templates (``trust_kernels=True`` loads
the folder's ``kernel.so`` instead). CUDA cubins are GPU code and load without TVM. Saving never
deletes anything but an earlier save (``sparta.saved_folder``). See ``docs/saved-models.md``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from . import saved_folder, saved_weights
from .codegen.cache import file_digest
from .errors import ArgumentTypeError, SpartaError
from .templates.registry import module_types
from .saved_checks import (FORMAT, MANIFEST, RENAMED, TENSORS, VERSION, SavedModelError, check_declared, check_tensors,
                           declared_values, read_manifest)

MODULE_TYPES = {  # saved type name → "module:Class" with saved_state() / from_saved(): fx markers and every family
    "passthrough": "sparta.backend.fx:Passthrough",
    "fused": "sparta.backend.fx:Fused",
    **module_types(),
}
# what a malformed folder can raise from deep inside torch, safetensors or a module's from_saved
_MALFORMED = (SpartaError, KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError,
              RuntimeError, OSError, RecursionError)


def _module_type(module) -> str:
    for name, ref in MODULE_TYPES.items():
        mod_name, cls_name = ref.split(":")
        if type(module).__name__ == cls_name and type(module).__module__ == mod_name:
            return name
    raise SavedModelError(f"cannot save a kernel module of type {type(module).__qualname__}")


def _module_class(name: str):
    name = RENAMED.get(name, name)
    if name not in MODULE_TYPES:
        raise SavedModelError(f"saved model uses kernel module type {name!r}, which this sparta does not know")
    mod_name, cls_name = MODULE_TYPES[name].split(":")
    try:
        return getattr(importlib.import_module(mod_name), cls_name)
    except ImportError as exc:
        raise SavedModelError(f"kernel modules of type {name!r} need {exc.name!r}, which is not installed") from exc


def save(compiled, path, weights: bool = True) -> Path:
    """Write ``compiled`` to the folder ``path``: a new or empty folder, or an earlier save there,
    which is replaced atomically (any other content is refused, never deleted). ``weights=False``: a
    kernels-only save, whose weights ``sparta.load(path, weights=checkpoint)`` takes from the user's checkpoint."""
    if not isinstance(weights, bool):
        raise ArgumentTypeError(f"weights must be True or False, got {weights!r}")
    dest = Path(os.path.abspath(path))
    saved_folder.recover(dest)
    saved_folder.clean(dest)
    saved_folder.check_destination(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with saved_folder.TempFolder(dest) as tmp:
        _write(compiled, tmp.path, weights)
        tmp.publish()
    return Path(path)


def _write(compiled, root: Path, weights: bool = True) -> None:
    from safetensors.torch import save_file

    from . import __version__
    from .graph_json import graph_to_json

    (root / "kernels").mkdir()
    graph_json, tensors = graph_to_json(compiled.graph, stacked=weights)    # kernels only: no stacked copies
    restorable = _restorable_weights(compiled)
    for name in restorable:                           # the kernel module's packed copy restores it
        tensors.pop("graph/" + name, None)
    modules = {}
    for op_name, module in compiled.module_replacements().items():
        config, mtensors, folders = module.saved_state()
        entry = {"type": _module_type(module), "config": config, "tensors": sorted(mtensors),
                 "kernels": sorted(folders)}
        tensors.update({f"module/{op_name}/{k}": v for k, v in mtensors.items()})
        if getattr(module, "weight_name", None) in restorable:
            entry["restores"] = module.weight_name
        ref = getattr(module, "reference_weight", None)
        if ref is not None or getattr(module, "reference_dtype", None) is not None:
            entry["weight_name"] = module.weight_name
            if ref is None or _derivable(module, ref):     # the packed weights give it back: not stored twice
                entry["reference_dtype"] = str(module.reference_dtype if ref is None else ref.dtype).split(".")[-1]
            else:
                tensors[f"module/{op_name}/reference_weight"] = ref
        for key, folder in folders.items():
            _copy_kernel(Path(folder), root / "kernels" / key)
        modules[op_name] = entry
    decode = {}
    for what, module in compiled.decode_modules.items():      # their values live in their config (no weights)
        config, _, folders = module.saved_state()
        decode[what] = {"type": _module_type(module), "config": config, "kernels": sorted(folders)}
        for key, folder in folders.items():
            _copy_kernel(Path(folder), root / "kernels" / key)
    source = _source_json(compiled, tensors)
    records = saved_weights.records(compiled, not weights, tensors)
    if not weights:
        saved_weights.strip(compiled, tensors, modules, records)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(root / TENSORS))
    files = {p.relative_to(root).as_posix(): file_digest(p) for p in sorted(root.rglob("*")) if p.is_file()}
    kernels = [{k: v for k, v in row.items() if k != "artifact"} for row in compiled.kernels]
    manifest = {"format": FORMAT, "version": VERSION, "sparta": __version__, "torch": torch.__version__,
                "target": compiled.target, "graph": graph_json,
                "plan": compiled.plan.to_json() if compiled.plan is not None else None,
                "kernels": kernels, "timings": compiled.timings, "modules": modules, "files": files}
    if source is not None:
        manifest["source"] = source
    if decode:
        manifest["decode_modules"] = decode
    manifest["weights"] = records
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _source_json(compiled, tensors: dict) -> dict | None:
    """The source graph (the model with only the user's TeSAs) as JSON; its weights are the compiled
    graph's where they are the same tensor (``shared``: read back from ``graph/``), else stored as ``source/``."""
    from .graph_json import graph_to_json

    source = getattr(compiled, "source_graph", None)
    if source is None:
        return None
    data, own = graph_to_json(source, prefix="source/")
    shared, sliced = [], {}
    parts = {part: [stacked, start, end] for stacked, rows in compiled.graph.stacked_weights.items()
             for part, start, end in rows if compiled.graph.has_tensor(stacked)}
    for key, t in own.items():
        name = key.removeprefix("source/")
        if compiled.graph.has_tensor(name) and compiled.graph.tensor(name).data is t:
            shared.append(name)
        elif name in parts and _same(_rows(compiled.graph.tensor(parts[name][0]), *parts[name][1:]), t):
            sliced[name] = parts[name]       # rows of a stacked weight (sibling linears run as one)
        else:
            tensors[key] = t
    return {**data, "shared": sorted(shared), **({"sliced": sliced} if sliced else {})}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors; meta ones (a model compiled from the meta device: its stacked parts are its own parameters)
    of one shape and dtype."""
    if a.is_meta or b.is_meta:
        return a.is_meta and b.is_meta and a.shape == b.shape and a.dtype == b.dtype
    return torch.equal(a, b)


def _rows(value, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of a graph weight (of a stacked one without concatenating its parts)."""
    return value.rows(start, end) if hasattr(value, "rows") else value.data[start:end]


def _restorable_weights(compiled) -> set[str]:
    """Weights only kernel modules read, each module able to give it back (``graph_weight()``)."""
    replaced = compiled.module_replacements()
    read = {t for op in compiled.graph.ops() if op.name not in replaced for t in op.inputs}
    read |= set(compiled.graph.outputs)
    return {m.weight_name for m in replaced.values()
            if hasattr(m, "graph_weight") and m.weight_name is not None and m.weight_name not in read}


def _derivable(module, ref: torch.Tensor) -> bool:
    """Whether a kernel module's reference weight is exactly its own ``graph_weight()`` in ``ref``'s dtype (a meta one,
    of a model compiled from the meta device: whether it has one)."""
    return hasattr(module, "graph_weight") and (ref.is_meta or torch.equal(module.graph_weight().to(ref.dtype),
                                                                           ref.cpu()))


def _copy_kernel(src: Path, dest: Path) -> None:
    """Copy a kernel's artifact folder (its regular files; not the cache's own ``meta.json``)."""
    if not src.is_dir():
        raise SavedModelError(f"kernel folder {src} is gone (cache cleared?); recompile before saving")
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.is_symlink() and f.name != "meta.json":
            shutil.copy2(f, dest / f.name)


def read(path, build, trust_kernels: bool = False, weights=None):
    """The model written by ``compiled.save(path)``, made by ``build`` (the ``CompiledModel`` class) from the
    folder's graph, plan, kernel modules and reports; ``weights``: a checkpoint whose weights replace the saved
    ones (``sparta.saved_weights``); ``sparta.load`` is the public entry."""
    if not isinstance(trust_kernels, bool):     # a truthy "no" must not load native code
        raise ArgumentTypeError(f"trust_kernels must be True or False, got {trust_kernels!r}: pass True only for "
                                "a folder whose native code you trust")
    root = Path(path)
    saved_folder.recover(Path(os.path.abspath(path)))
    manifest = read_manifest(root)
    try:
        return _build(root, manifest, trust_kernels, build, weights)
    except SavedModelError:
        raise
    except _MALFORMED as exc:
        raise SavedModelError(f"saved model {root} is malformed: {type(exc).__name__}: {exc}") from exc


def _build(root: Path, manifest: dict, trust_kernels: bool, build, weights=None):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .graph_json import graph_from_json
    from .passes.transform.plan import Plan

    try:
        # own, aligned copies: safetensors' mmapped tensors are only 8-byte aligned (TVM's kernels assume 64)
        tensors = {k: v.clone() for k, v in load_file(str(root / TENSORS)).items()}
    except SafetensorError as exc:
        raise SavedModelError(f"saved model {root}: {TENSORS} is not a valid safetensors file: {exc}") from exc
    check_tensors(manifest, tensors, root)
    if weights is None and (manifest.get("weights") or {}).get("kernels_only"):
        raise SavedModelError(f"saved model {root} holds kernels only, no weights: load it with "
                              "sparta.load(path, weights=<your checkpoint>)")
    if weights is not None:
        fit_on = saved_weights.fill(manifest, tensors, weights, root)
    replacements = _load_modules(root, manifest, tensors, trust_kernels, repacking=weights is not None)
    graph = graph_from_json(manifest["graph"], tensors)
    plan = Plan.from_json(manifest["plan"]) if manifest.get("plan") is not None else None
    if weights is not None:
        saved_weights.repack(graph, plan, replacements, manifest, root, tensors,
                             lambda op_name, module, entry: _restore_weights(
                                 root, op_name, module, entry, tensors, declared_values(manifest, root), graph),
                             fit_on=fit_on)
    source = None
    if "source" in manifest:    # weights a kernel restored stand in for the originals it does not keep
        shared = {"source/" + n: tensors.get("graph/" + n) for n in manifest["source"]["shared"]}
        declared = {v["name"]: v for v in manifest["source"].get("tensors", [])}
        for n, (stacked, start, end) in manifest["source"].get("sliced", {}).items():
            whole = tensors.get("graph/" + stacked)
            if whole is None or end > whole.shape[0] or n not in declared \
                    or [end - start, *whole.shape[1:]] != list(declared[n]["shape"]):
                raise SavedModelError(f"saved model {root}: the source weight {n!r} is not rows {start}:{end} of a "
                                      "stacked weight the model holds")
            shared["source/" + n] = whole[start:end].clone()
        if any(t is None for t in shared.values()):
            raise SavedModelError(f"saved model {root}: the source graph shares a weight the model does not hold")
        source_tensors = {**shared, **{k: v for k, v in tensors.items() if k.startswith("source/")}}
        source_json = {k: v for k, v in manifest["source"].items() if k not in ("shared", "sliced")}
        source = graph_from_json(source_json, source_tensors, prefix="source/")
    kernels = [dict(row) for row in manifest.get("kernels", [])]
    compiled = build(graph, target=manifest["target"], plan=plan, replacements=replacements,
                     timings=manifest.get("timings"), kernels=kernels, source=source)
    compiled.decode_modules = _decode_modules(root, manifest)
    return compiled


def _decode_modules(root: Path, manifest: dict) -> dict:
    """The kernel modules only ``generate()``'s decode steps run (``manifest["decode_modules"]``)."""
    out = {}
    for what, entry in (manifest.get("decode_modules") or {}).items():
        cls = _module_class(entry["type"])
        folders = {key: _kernel_folder(root, key) for key in entry["kernels"]}
        try:
            out[str(what)] = cls.from_saved(entry["config"], {}, folders)
        except SpartaError as exc:
            raise SavedModelError(f"saved model {root}: decode kernel {what!r} cannot be restored: {exc}") from exc
    return out


def _load_modules(root: Path, manifest: dict, tensors: dict, trust_kernels: bool, repacking: bool = False) -> dict:
    declared = declared_values(manifest, root)
    replacements = {}
    for op_name, entry in manifest["modules"].items():
        cls = _module_class(entry["type"])
        prefix = f"module/{op_name}/"
        missing = [k for k in entry["tensors"] if prefix + k not in tensors]
        if missing:
            raise SavedModelError(f"saved model {root}: malformed kernel module entry {op_name!r} "
                                  f"(tensor {missing[0]!r} is not stored)")
        mtensors = {k: tensors[prefix + k] for k in entry["tensors"]}
        folders = {key: _kernel_folder(root, key) for key in entry["kernels"]}
        options = {"trust_kernels": trust_kernels} if getattr(cls, "native_kernels", False) else {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                module = cls.from_saved(entry["config"], mtensors, folders, **options)
        except SavedModelError:
            raise
        except SpartaError as exc:
            raise SavedModelError(f"saved model {root}: kernel module {op_name!r} cannot be restored: {exc}") from exc
        except _MALFORMED as exc:
            raise SavedModelError(f"saved model {root}: kernel module {op_name!r} cannot be restored "
                                  f"(malformed kernel module entry: {type(exc).__name__}: {exc})") from exc
        for name in (entry.get("weight_name"), entry.get("restores")):
            if name is not None and name not in declared:
                raise SavedModelError(f"saved model {root}: kernel module {op_name!r} names an unknown weight {name!r}")
        if not repacking:                            # else after packing the checkpoint's weights
            _restore_weights(root, op_name, module, entry, tensors, declared)
        replacements[op_name] = module
    return replacements


def _restore_weights(root: Path, op_name: str, module, entry: dict, tensors: dict, declared: dict,
                     graph=None) -> None:
    """A kernel module's reference weight and the graph weight it restores (``restores``), from its packed weights
    (or, for a reference it cannot give back, the stored one, or the one its ``repack`` made)."""
    from .graph_json import dtype_of
    prefix = f"module/{op_name}/"
    rebuilt = module.graph_weight() if "reference_dtype" in entry or "restores" in entry else None
    if "weight_name" in entry:
        module.weight_name = entry["weight_name"]
        if "reference_dtype" in entry:              # rebuilt from the packed weights when read
            module.reference_weight, module.reference_dtype = None, dtype_of(entry["reference_dtype"])
            got = tuple(rebuilt.shape)
        else:
            if graph is None or getattr(module, "reference_weight", None) is None:
                module.reference_weight = tensors[prefix + "reference_weight"]
            got = tuple(module.reference_weight.shape)
        shape = tuple(declared[entry["weight_name"]]["shape"])
        if got != shape:
            raise SavedModelError(f"saved model {root}: kernel module {op_name!r} gives weight "
                                  f"{entry['weight_name']!r} the shape {list(got)}, the graph declares {list(shape)}")
    if "restores" in entry:                      # restored weights come back in the graph's dtype
        value = declared[entry["restores"]]
        restored = rebuilt.to(dtype_of(value["dtype"]))
        check_declared(value, restored, root)
        tensors["graph/" + entry["restores"]] = restored
        if graph is not None:
            graph.tensor(entry["restores"]).data = restored


def _kernel_folder(root: Path, key: str) -> Path:
    """A kernel folder of the saved model; CUDA launch specs are checked before any kernel loads."""
    folder = root / "kernels" / key
    if not folder.is_dir():
        raise SavedModelError(f"saved model {root} is missing its kernel folder kernels/{key}")
    if (folder / "launch.json").is_file():
        from .runtime.cuda import CudaRuntimeError, check_launch
        try:
            check_launch(folder)
        except CudaRuntimeError as exc:
            raise SavedModelError(f"saved model {root}: kernels/{key}: {exc}") from exc
    return folder


__all__ = ["save", "read", "read_manifest", "SavedModelError", "MODULE_TYPES"]
