"""Weights from the user's checkpoint: kernels-only saves (``compiled.save(path, weights=False)``) and
``sparta.load(path, weights=...)``.

A save records, in its manifest's ``weights`` entry, every weight the model reads from a checkpoint: its name
(a stacked weight: its parts' rows), the other names a checkpoint may hold it under (tied weights) and the
user's TeSA of each (the mask the kernels were specialised to, bit-packed). A kernels-only save leaves out the
weights' values: the graph's parameters, the kernel modules' packed values (their index tables, which the masks
give, stay) and the source graph's parameters; each left-out module tensor is recorded by shape and dtype.

At load every weight is read from the checkpoint (a module, a state dict, safetensors files; never a pickle),
checked (present, shape, dtype, zero where the user's TeSA prunes, a pruning mask equal to the compiled one) and
packed by its kernel module's own packing code (``repack``, what the build runs). See ``docs/saved-models.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .saved_checks import SavedModelError, check_declared, declared_values

_ROLES = ("weight", "bias")


# ---- saving -------------------------------------------------------------------------------------------------
def records(compiled, kernels_only: bool, tensors: dict) -> dict:
    """The manifest's ``weights`` entry of ``compiled`` (``tensors``: what the save stores)."""
    graph, source = compiled.graph, getattr(compiled, "source_graph", None)
    aliases = _aliases(graph)
    out = []
    for v in graph.tensors():
        if not v.has_data or not (v.is_parameter or v.name in graph.stacked_weights):
            continue
        rec = {"name": v.name, "names": [v.name, *aliases.get(v.name, [])]}
        parts = graph.stacked_weights.get(v.name)
        if parts:
            rec["parts"] = [list(p) for p in parts]
        masks = {n: _user_tesa(source, n) for n in ([p[0] for p in parts] if parts else [v.name])}
        masks = {n: t.to_json() for n, t in masks.items() if t is not None and not t.is_dense}
        if masks:
            rec["masks"] = masks
        out.append(rec)
    source_names = [v.name for v in source.tensors() if v.is_parameter and "source/" + v.name in tensors] \
        if source is not None else []
    return {"kernels_only": kernels_only, "graph": out, "source": source_names}


def strip(compiled, tensors: dict, modules: dict, weights: dict) -> None:
    """Leave the weights' values out of ``tensors`` (in place): a kernels-only save."""
    derived = getattr(compiled.plan, "derived", None) or {}
    if derived:                 # folded BatchNorms, shrunk channels: constants a checkpoint does not hold
        name, how = next(iter(derived.items()))
        raise SavedModelError(f"cannot save without weights: {len(derived)} constants are computed from the weights "
                              f"at compile time (e.g. {name!r}: {how}); save with weights=True")
    for rec in weights["graph"]:
        tensors.pop("graph/" + rec["name"], None)
    for name in weights["source"]:
        tensors.pop("source/" + name, None)
    omitted = {}
    for op_name, module in compiled.module_replacements().items():
        entry = modules[op_name]
        if not entry["tensors"]:
            continue
        why = module.baked_values() if hasattr(module, "baked_values") else None
        if not hasattr(module, "repack") or why is not None:
            raise SavedModelError(f"op {op_name!r} cannot be saved without its weights: "
                                  f"{why or f'its kernel module ({type(module).__name__}) cannot pack a checkpoint'}; "
                                  "save with weights=True" + (" or compile with dismantle='tile'" if why else ""))
        keep = module.plan_tensors() if callable(getattr(module, "plan_tensors", None)) else \
            set(getattr(module, "plan_tensors", ()))
        dropped = {}
        for name in entry["tensors"]:
            if name not in keep:
                t = tensors.pop(f"module/{op_name}/{name}")
                dropped[name] = [list(t.shape), str(t.dtype).removeprefix("torch.")]
        tensors.pop(f"module/{op_name}/reference_weight", None)
        omitted[op_name] = dropped
    weights["omitted"] = omitted


def _aliases(graph) -> dict[str, list[str]]:
    """Other names of a weight: ``<module>.weight`` / ``.bias`` of each module that reads it (a tied weight: the
    checkpoint may hold it under any of its owners' names)."""
    out: dict[str, list[str]] = {}
    for op in graph.ops():
        path = (op.source or "").split(" ", 1)[0]
        if not path or path == "File" or not all(p.isidentifier() or p.isdigit() for p in path.split(".")):
            continue
        for name, role in zip(op.inputs, op.roles):
            alias = f"{path}.{role}"
            if role in _ROLES and alias != name and graph.has_tensor(name) and alias not in out.get(name, []):
                out.setdefault(name, []).append(alias)
    return out


def _user_tesa(source, name: str):
    if source is None or not source.has_tensor(name):
        return None
    return source.tensor(name).tesa


# ---- loading ------------------------------------------------------------------------------------------------
class Checkpoint:
    """Tensors by name from an ``nn.Module`` (its state dict), a state dict, a safetensors file, a folder of
    ``*.safetensors`` or a list of safetensors files (a sharded checkpoint)."""

    def __init__(self, weights):
        self._dict, self._files, self.device = None, {}, None
        if isinstance(weights, torch.nn.Module):
            self._dict = dict(weights.state_dict())
        elif isinstance(weights, Mapping):
            self._dict = dict(weights)
        elif isinstance(weights, (str, os.PathLike, list, tuple)):
            self._open(weights)
        else:
            raise SavedModelError(f"weights must be an nn.Module, a state dict or safetensors file(s), got "
                                  f"{type(weights).__name__}")
        if self._dict is not None:
            bad = [k for k, v in self._dict.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
            if bad:
                raise SavedModelError(f"weights: entry {bad[0]!r} is not a tensor named by a string")
            self.device = next((v.device for v in self._dict.values() if v.is_cuda), None)   # a checkpoint on a GPU

    def _open(self, weights) -> None:
        from safetensors import SafetensorError, safe_open
        paths = [Path(p) for p in ([weights] if isinstance(weights, (str, os.PathLike)) else weights)]
        if len(paths) == 1 and paths[0].is_dir():
            paths = sorted(paths[0].glob("*.safetensors"))
            if not paths:
                raise SavedModelError(f"weights: {weights} holds no *.safetensors files")
        for path in paths:
            if not isinstance(path, Path) or path.suffix != ".safetensors" or not path.is_file():
                raise SavedModelError(f"weights: {path} is not a .safetensors file (checkpoints are read from "
                                      "safetensors only, never unpickled)")
            try:
                with safe_open(str(path), framework="pt") as f:
                    keys = list(f.keys())
            except (SafetensorError, OSError) as exc:
                raise SavedModelError(f"weights: {path} is not a valid safetensors file: {exc}") from exc
            for key in keys:
                if key in self._files:
                    raise SavedModelError(f"weights: {key!r} is in both {self._files[key]} and {path}")
                self._files[key] = path

    def __contains__(self, name: str) -> bool:
        return name in (self._dict if self._dict is not None else self._files)

    def get(self, name: str) -> torch.Tensor:
        if self._dict is not None:
            return self._dict[name].detach().cpu().clone()
        from safetensors import safe_open
        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name).clone()


def fill(manifest: dict, tensors: dict, weights, root: Path):
    """Put the checkpoint's weights into ``tensors`` (``graph/``, ``source/``) after checking them, and shaped
    placeholders for the module tensors a kernels-only save left out (packed again by :func:`repack`). Returns the GPU
    the checkpoint's tensors are on (None: the CPU, or files), where :func:`repack` fits scales left to the load."""
    from .tesa import TeSA
    rec = manifest.get("weights")
    if not isinstance(rec, dict):
        raise SavedModelError(f"saved model {root} records no weights to take from a checkpoint (written by an older "
                              "sparta); save it again to load it with weights=")
    ckpt = Checkpoint(weights)
    declared = declared_values(manifest, root)
    source = declared_values({"graph": manifest["source"]}, root) if "source" in manifest else {}
    masks = {n: TeSA.from_json(m) for r in rec["graph"] for n, m in r.get("masks", {}).items()}
    for r in rec["graph"]:
        value = declared.get(r["name"])
        if value is None:
            raise SavedModelError(f"saved model {root}: its weight records name an unknown tensor {r['name']!r}")
        if "parts" in r:
            rows = [_read(ckpt, [part], masks.get(part), value, end - start, root) for part, start, end in r["parts"]]
            t = torch.cat(rows)
        else:
            t = _read(ckpt, r["names"], masks.get(r["name"]), value, None, root)
        check_declared(value, t, root)
        tensors["graph/" + r["name"]] = t
    for name in rec.get("source", []):
        if name not in source:
            raise SavedModelError(f"saved model {root}: its weight records name an unknown source tensor {name!r}")
        tensors["source/" + name] = _read(ckpt, [name], masks.get(name), source[name], None, root)
    for op_name, omitted in rec.get("omitted", {}).items():
        for name, (shape, dtype) in omitted.items():
            tensors[f"module/{op_name}/{name}"] = torch.zeros(shape, dtype=getattr(torch, dtype))
    return ckpt.device


def _read(ckpt: Checkpoint, names: list[str], tesa, value: dict, rows: int | None, root: Path) -> torch.Tensor:
    """The checkpoint's tensor for a weight (by any of ``names``; torch's pruning form ``<name>_orig`` with
    ``<name>_mask`` too), checked against its declaration (``rows``: a part of a stacked weight) and mask."""
    name = names[0]
    shape = [rows, *value["shape"][1:]] if rows is not None else list(value["shape"])
    found = next((n for n in names if n in ckpt), None)
    mask = None
    if found is not None:
        t = ckpt.get(found)
    elif name + "_orig" in ckpt and name + "_mask" in ckpt:
        found, mask = name + "_orig", ckpt.get(name + "_mask")
        t = ckpt.get(found)
        if mask.shape != t.shape:
            raise SavedModelError(f"weights: {name}_mask has shape {list(mask.shape)}, the weight {list(t.shape)}")
        t = torch.where(mask.bool(), t, torch.zeros((), dtype=t.dtype))
    else:
        also = f" (or {', '.join(map(repr, names[1:]))})" if len(names) > 1 else ""
        raise SavedModelError(f"weights: the checkpoint has no tensor {name!r}{also}, which the saved model "
                              f"{root} needs; pass the checkpoint of the model it was compiled from")
    dtype = value["dtype"]
    if list(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
        raise SavedModelError(f"weights: {found!r} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, the "
                              f"saved model {root} was compiled for {dtype} {shape}; convert it or compile again")
    if tesa is not None:
        keep = tesa.mask
        if mask is not None and not torch.equal(mask.bool(), keep):
            raise SavedModelError(f"weights: {name}_mask differs from the mask {name!r} was compiled with "
                                  f"({int((mask.bool() != keep).sum())} elements); the kernels are specialised to "
                                  "that mask: compile again for the new one")
        stray = int(((t != 0) & ~keep).sum())
        if stray:
            raise SavedModelError(f"weights: {found!r} is non-zero at {stray} elements its compiled mask prunes; "
                                  f"the kernels are specialised to that mask: prune it with the same mask (weight * "
                                  "mask), or compile again for the new one")
    return t


def repack(graph, plan, replacements: dict, manifest: dict, root: Path, tensors: dict, restore,
           fit_on=None) -> None:
    """Pack each kernel module's weights from the graph's (the checkpoint's) by its own packing code; the index
    tensors a kernels-only save kept must come out the same (else the mask differs from the compiled one). Scales a
    plan leaves to the load (a meta-device compile's 4-bit weights) are fitted on ``fit_on`` (None: the CPU)."""
    from .passes.quant.scheme import fit_device
    with fit_device(fit_on):
        _repack(graph, plan, replacements, manifest, root, restore)


def _repack(graph, plan, replacements: dict, manifest: dict, root: Path, restore) -> None:
    for op_name, module in replacements.items():
        entry = manifest["modules"][op_name]
        if not entry["tensors"]:
            continue
        if not hasattr(module, "repack"):
            raise SavedModelError(f"saved model {root}: kernel module {op_name!r} ({type(module).__name__}) cannot "
                                  "take a checkpoint's weights")
        keep = module.plan_tensors() if callable(getattr(module, "plan_tensors", None)) else \
            set(getattr(module, "plan_tensors", ()))
        before = {n: module._buffers[n].clone() for n in keep if module._buffers.get(n) is not None}
        op_plan = plan.ops.get(op_name) if plan is not None else None
        try:
            module.repack(graph, op_plan)
        except (SavedModelError, KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise SavedModelError(f"weights: kernel module {op_name!r} cannot pack the checkpoint's weights: "
                                  f"{exc}") from exc
        except Exception as exc:
            from .errors import SpartaError
            if not isinstance(exc, SpartaError):
                raise
            raise SavedModelError(f"weights: kernel module {op_name!r} cannot pack the checkpoint's weights: "
                                  f"{exc}") from exc
        for n, old in before.items():
            new = module._buffers.get(n)
            if new is None or new.shape != old.shape or not torch.equal(new.cpu(), old.cpu()):
                raise SavedModelError(f"weights: op {op_name!r}: the checkpoint's weight gives its kernels another "
                                      f"block structure ({n}) than they were built for: the mask differs from the "
                                      "compiled one; compile again for the new mask")
        restore(op_name, module, entry)


__all__ = ["records", "strip", "fill", "repack", "Checkpoint"]
