"""Checks of a saved model's folder, made before anything in it is used (``docs/saved-models.md``).

A folder is refused with :class:`SavedModelError` unless it holds only folders and regular files
(no symbolic links), every file but the manifest is listed in the manifest and matches its
SHA-256, and the manifest is one this sparta reads: its format, an integer version from 1 to
:data:`VERSION` that covers the features the model uses, and fields of the expected types.
The stored tensors are then checked against the shapes and dtypes the graph declares.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath

import torch

from .codegen.cache import file_digest
from .errors import SpartaError

MANIFEST, TENSORS, FORMAT = "sparta.json", "tensors.safetensors", "sparta-saved"
VERSION = 11  # 2: a kernel module's reference weight may be rebuilt from its packed weights (reference_dtype);
#               3: W4A16 GEMV specs may split K over CTAs (ksplit); LayerNorms may fuse a residual add;
#               4: W8A8 GEMV modules (w8a8_gemv_cuda)
#               5: the source graph (the model with only the user's TeSAs) that verify() checks against
#               6: CUDA epilogues name the exact GELU "gelu" and the tanh form "gelu_tanh" (before: "gelu_erf", "gelu")
#               7: CPU int4 blocks hold each register slice's halves in low/high nibbles; CPU int8 linears
#                  (int8_linear_cpu); weight-only int8 CPU blocks (act_bits)
#               8: low-bit tile kernels of any M with their few-row GEMVs (few_rows); GEMV specs of any M (rows)
#               9: module types named by their kernel family (bsr_linear, norm, cpu_linear, ...; RENAMED)
#              10: kernels-only saves (weights: the weights' records; their values come from the user's checkpoint)
#              11: one packed weight per low-bit linear of any M: W4A16 tiles read their GEMVs' pack (gemv_group),
#                  W8A8 GEMVs the tile's blocks (bn, bk)
RENAMED = {"bsr_linear_cuda": "bsr_linear", "w4a16_gemv_cuda": "w4a16_gemv", "w8a8_gemv_cuda": "w8a8_gemv",
           "layer_norm_cuda": "norm", "sparse_linear_cpu": "cpu_linear", "int8_linear_cpu": "onednn_int8"}  # before 9
CUDA_SINCE = 6     # older CUDA models name their GELUs otherwise: refused, not run with the other GELU
CPU_INT4_SINCE = 7  # older CPU int4 blocks pair neighbouring rows in a byte: refused, not run with another packing
TARGETS = ("cpu", "cuda")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REQUIRED = {"format": str, "version": int, "target": str, "graph": dict, "modules": dict, "files": dict}
_OPTIONAL = {"plan": (dict, type(None)), "kernels": list, "timings": (dict, type(None)), "sparta": str,
             "torch": str, "source": dict, "weights": dict}
_ENTRY = {"type": str, "config": dict, "tensors": list, "kernels": list}
_ENTRY_OPTIONAL = ("restores", "weight_name", "reference_dtype")


class SavedModelError(SpartaError):
    """A saved model that cannot be written or read: missing, altered, malformed, or from a newer sparta."""


def folder_entries(root: Path) -> tuple[set[str], set[str]]:
    """``(files, folders)`` under ``root`` as relative POSIX paths; refuses symbolic links and special files."""
    files, folders, stack = set(), set(), [root]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                rel = Path(e.path).relative_to(root).as_posix()
                if e.is_symlink():
                    raise SavedModelError(f"saved model {root}: {rel} is a symbolic link; a saved model holds "
                                          "only its own files")
                if e.is_dir(follow_symlinks=False):
                    folders.add(rel)
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False):
                    files.add(rel)
                else:
                    raise SavedModelError(f"saved model {root}: {rel} is not a regular file")
    return files, folders


def parse_manifest(root: Path) -> dict:
    """The manifest's JSON (not yet checked); refuses a folder without one."""
    try:
        fd = os.open(root / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SavedModelError(f"{root} is not a saved sparta model (no {MANIFEST})") from None
    except OSError as exc:
        raise SavedModelError(f"{root / MANIFEST} cannot be read: {exc}") from exc
    with os.fdopen(fd, "rb") as f:
        text = f.read()
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SavedModelError(f"{root / MANIFEST} is not valid JSON: {exc}") from exc


def is_sparta_manifest(manifest) -> bool:
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)


def read_manifest(path) -> dict:
    """The manifest of a saved model, after checking the folder's files and the manifest's structure."""
    root = Path(path)
    if not root.is_dir():
        raise SavedModelError(f"{root} is not a saved sparta model (no such folder)")
    files, _ = folder_entries(root)
    manifest = parse_manifest(root)
    check_structure(manifest, root)
    listed = manifest["files"]
    unlisted = sorted(files - set(listed) - {MANIFEST})
    if unlisted:
        raise SavedModelError(f"saved model {root}: {unlisted[0]} is not listed in {MANIFEST} "
                              "(every file of a saved model is listed with its SHA-256)")
    for rel, digest in listed.items():
        if rel not in files:
            raise SavedModelError(f"saved model {root} is missing {rel}")
        if file_digest(root / rel) != digest:
            raise SavedModelError(f"saved model {root}: {rel} was altered (SHA-256 mismatch)")
    if TENSORS not in listed:
        raise SavedModelError(f"saved model {root} lists no {TENSORS}")
    check_version_features(manifest, root)
    return manifest


def check_relative(rel, root: Path) -> None:
    """Refuse a listed path that is not a plain relative path inside the folder."""
    pure = PurePosixPath(rel) if isinstance(rel, str) else None
    if pure is None or pure.is_absolute() or ".." in pure.parts or pure.as_posix() != rel or "\\" in rel:
        raise SavedModelError(f"saved model {root} lists a file outside its folder: {rel!r}")


def check_structure(manifest, root: Path) -> None:
    """Refuse a manifest whose format, version or fields are not what this sparta writes."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise SavedModelError(f"{root} is not a saved sparta model (format {fmt!r})")
    version = manifest.get("version")
    if type(version) is not int:
        raise SavedModelError(f"saved model {root}: format version must be an integer, got {version!r}")
    if version > VERSION:
        raise SavedModelError(f"{root} was saved by a newer sparta (format version {version}); "
                              f"this one reads version {VERSION}")
    if version < 1:
        raise SavedModelError(f"saved model {root}: format version {version} was never written by sparta")
    _check_fields(manifest, _REQUIRED, _OPTIONAL, f"saved model {root}: manifest")
    if manifest["target"] not in TARGETS:
        raise SavedModelError(f"saved model {root}: unknown target {manifest['target']!r} (expected one of {TARGETS})")
    if manifest["target"] == "cuda" and version < CUDA_SINCE:
        raise SavedModelError(f"saved model {root} was written by an older sparta (format version {version}) whose "
                              "CUDA kernels name their GELUs differently; compile and save the model again")
    if manifest["target"] == "cpu" and version < CPU_INT4_SINCE and _cpu_int4(manifest):
        raise SavedModelError(f"saved model {root} was written by an older sparta (format version {version}) whose "
                              "CPU int4 kernels packed their nibbles otherwise; compile and save the model again")
    for rel, digest in manifest["files"].items():
        check_relative(rel, root)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise SavedModelError(f"saved model {root}: the SHA-256 of {rel!r} is malformed")
    for op_name, entry in manifest["modules"].items():
        what = f"saved model {root}: kernel module entry {op_name!r}"
        if not isinstance(entry, dict):
            raise SavedModelError(f"{what} is malformed (not an object)")
        _check_fields(entry, _ENTRY, {k: str for k in _ENTRY_OPTIONAL}, what)
        for key in ("tensors", "kernels"):
            if not all(isinstance(x, str) for x in entry[key]):
                raise SavedModelError(f"{what} is malformed: {key} must be names")
        if any(not key.isascii() or not key.isalnum() for key in entry["kernels"]):
            raise SavedModelError(f"{what}: kernel folder names must be plain keys")
    if not all(isinstance(row, dict) for row in manifest.get("kernels", [])):
        raise SavedModelError(f"saved model {root}: malformed kernel report (rows must be objects)")


def _cpu_sub_specs(entry) -> list[dict]:
    """The spec fields of a CPU kernel module entry's sub-kernels (saved encoded: ``{"$dict": {...}}``)."""
    config = entry.get("config") if isinstance(entry, dict) else None
    subs = config.get("subs") if isinstance(config, dict) else None
    specs = [s.get("spec") for s in subs if isinstance(s, dict)] if isinstance(subs, list) else []
    specs = [s.get("$dict", s) for s in specs if isinstance(s, dict)]
    return [s for s in specs if isinstance(s, dict)]


def _cpu_int4(manifest: dict) -> bool:
    """Whether a CPU model's kernel modules run int4 blocks."""
    return any(s.get("weight_bits") == 4 for e in manifest["modules"].values() for s in _cpu_sub_specs(e))


def _check_fields(obj: dict, required: dict, optional: dict, what: str) -> None:
    for key, kind in required.items():
        if key not in obj:
            raise SavedModelError(f"{what} is malformed: it lacks {key!r}")
    for key, kind in {**required, **optional}.items():
        if key in obj and (not isinstance(obj[key], kind) or isinstance(obj[key], bool) and kind is int):
            raise SavedModelError(f"{what} is malformed: {key!r} has type {type(obj[key]).__name__}")


def check_version_features(manifest: dict, root: Path) -> None:
    """Refuse a manifest that declares an older format version than the features it uses."""
    for need, feature in _features(manifest):
        if manifest["version"] < need:
            raise SavedModelError(f"saved model {root} declares format version {manifest['version']} but uses "
                                  f"{feature}, which version {need} introduced")


def _features(manifest: dict):
    for op_name, entry in manifest["modules"].items():
        config, kind = entry["config"], RENAMED.get(entry["type"], entry["type"])
        spec = config.get("spec") if isinstance(config.get("spec"), dict) else {}
        if "reference_dtype" in entry:
            yield 2, f"a reference weight rebuilt from packed weights (op {op_name!r})"
        if kind == "w4a16_gemv" and spec.get("ksplit", 1) != 1:
            yield 3, f"a split-K W4A16 GEMV (op {op_name!r})"
        if kind == "norm" and config.get("residual_name"):
            yield 3, f"a LayerNorm with a fused residual add (op {op_name!r})"
        if kind == "w8a8_gemv":
            yield 4, f"a W8A8 GEMV module (op {op_name!r})"
        if config.get("few_rows") or (kind in ("w4a16_gemv", "w8a8_gemv") and spec.get("rows")):
            yield 8, f"a low-bit GEMV of any M (op {op_name!r})"
        if spec.get("gemv_group") or any(isinstance(e, dict) and isinstance(e.get("spec"), dict) and e["spec"].get("bn")
                                         for e in config.get("few_rows") or ()):
            yield 11, f"a low-bit tile and its few-row GEMVs over one packed weight (op {op_name!r})"
        if kind == "onednn_int8":
            yield 7, f"a CPU int8 linear (op {op_name!r})"
        if kind == "cpu_linear" and any(s.get("act_bits") for s in _cpu_sub_specs(entry)):
            yield 7, f"a weight-only int8 CPU kernel (op {op_name!r})"
    if "source" in manifest:
        yield 5, "a source graph"
    if isinstance(manifest.get("weights"), dict) and manifest["weights"].get("kernels_only"):
        yield 10, "a kernels-only save (weights from a checkpoint)"


def is_row_range(r) -> bool:
    """Whether ``r`` is ``[tensor name, first row, end row]`` with ``0 <= first < end`` (a part of a stacked weight)."""
    return (isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and all(type(x) is int for x in r[1:])
            and 0 <= r[1] < r[2])


def check_tensors(manifest: dict, tensors: dict[str, torch.Tensor], root: Path) -> None:
    """Refuse stored tensors the manifest does not name, and graph weights whose stored shape or
    dtype differ from the graph's declaration (weights a kernel module restores are checked on restore)."""
    expected = set()
    restored = {e["restores"] for e in manifest["modules"].values() if "restores" in e}
    for op_name, entry in manifest["modules"].items():
        expected |= {f"module/{op_name}/{t}" for t in entry["tensors"]}
        if "weight_name" in entry and "reference_dtype" not in entry:
            expected.add(f"module/{op_name}/reference_weight")
    for v in _declared(manifest, root):
        if v["data"] and v["name"] not in restored:
            expected.add("graph/" + v["name"])
            stored = tensors.get("graph/" + v["name"])
            if stored is not None:
                check_declared(v, stored, root)
    source = manifest.get("source")
    if source is not None:
        shared, sliced = source.get("shared", []), source.get("sliced", {})
        if not isinstance(shared, list) or not all(isinstance(n, str) for n in shared):
            raise SavedModelError(f"saved model {root}: malformed source graph (shared must be names)")
        if not isinstance(sliced, dict) or not all(is_row_range(r) for r in sliced.values()):
            raise SavedModelError(f"saved model {root}: malformed source graph (sliced must be [weight, start, end])")
        for v in _declared({"graph": source}, root):
            if v["data"] and v["name"] not in shared and v["name"] not in sliced:
                expected.add("source/" + v["name"])
                if (stored := tensors.get("source/" + v["name"])) is not None:
                    check_declared(v, stored, root)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise SavedModelError(f"saved model {root}: {TENSORS} holds {extra[0]!r}, which the manifest does not name")


def check_declared(value: dict, tensor: torch.Tensor, root: Path) -> None:
    """Refuse ``tensor`` unless it has the shape and dtype the graph declares for ``value``."""
    shape, dtype = tuple(value["shape"]), value["dtype"]
    if tuple(tensor.shape) != shape or str(tensor.dtype).removeprefix("torch.") != dtype:
        raise SavedModelError(f"saved model {root}: weight {value['name']!r} is stored as {tensor.dtype} "
                              f"{list(tensor.shape)}, the graph declares {dtype} {list(shape)}")


def _declared(manifest: dict, root: Path) -> list[dict]:
    values = manifest["graph"].get("tensors")
    ok = isinstance(values, list) and all(
        isinstance(v, dict) and isinstance(v.get("name"), str) and isinstance(v.get("shape"), list)
        and all(type(s) is int for s in v["shape"]) and isinstance(v.get("dtype"), str)
        and isinstance(v.get("data"), bool) for v in values)
    if not ok:
        raise SavedModelError(f"saved model {root}: malformed graph tensor list")
    return values


def declared_values(manifest: dict, root: Path) -> dict[str, dict]:
    """The graph's tensor declarations by name."""
    return {v["name"]: v for v in _declared(manifest, root)}


__all__ = ["SavedModelError", "read_manifest", "check_tensors", "check_declared", "declared_values",
           "folder_entries", "parse_manifest", "is_sparta_manifest", "MANIFEST", "TENSORS", "FORMAT", "VERSION"]
