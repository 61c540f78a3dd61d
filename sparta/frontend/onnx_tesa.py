"""How TeSAs travel through an ONNX file: the records :func:`to_onnx` writes and :func:`from_onnx` reads.

Every record is ``metadata_props["sparta.tesa.<tensor>"]``, JSON with ``"format": 2``:

- a weight (every one, dense or not): its TeSA, the initializer that holds it (``initializer``, and
  ``perm`` when the file stores it permuted: the weight is ``initializer.permute(perm)``), the SHA-256 of
  its values and of its transpose, and the nodes that read that initializer. On import the record binds to the initializer
  with those contents that those nodes read (:mod:`sparta.frontend.onnx_identity`), whatever it is
  called by then, never to a tensor that merely has the name;
- a graph input or output: its TeSA and its position (the exporter is given the names and order).

Other activations are not stored: nothing in an ONNX file ties an intermediate value to a sparta tensor,
and propagation re-derives them from the weights. ``metadata_props["sparta.aliases"]`` keeps the graph's
aliases (tied parameters) by the weight they name. Records without ``format`` (older sparta) carry no
identity and are dropped with a warning.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx
import torch

from ..errors import CaptureError, TeSAError
from ..graph import Graph
from ..tesa import TeSA, bits_of_dtype
from .onnx_identity import (Claim, EditableModel, Resolution, digests, fold_identity_constants, initializer_tensor,
                            raise_errors, resolve, same_name, tensor_digest)

TESA_PREFIX = "sparta.tesa."
ALIASES_KEY = "sparta.aliases"
FORMAT = 2


# -- export -----------------------------------------------------------------------------------------
def write_records(graph: Graph, model: onnx.ModelProto) -> list[str]:
    """Add the graph's TeSAs and aliases to ``model``; returns the activations whose TeSAs are not stored."""
    inits = {i.name: i for i in model.graph.initializer}
    readers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for name in set(node.input):
            readers.setdefault(name, []).append(node.name)
    by_digest: dict[str, list[tuple[str, tuple | None]]] | None = None
    aliases = graph.meta.get("aliases", {})
    skipped = []

    def locate(v):
        """(initializer, perm, digest, transposed digest) of a weight; None where the file does not hold it."""
        nonlocal by_digest
        digest, digest_t = digests(v.data)
        if v.name in inits and tensor_digest(initializer_tensor(inits[v.name])) == digest:
            return v.name, None, digest, digest_t
        if by_digest is None:
            by_digest = {}
            for name, init in inits.items():
                by_digest.setdefault(tensor_digest(initializer_tensor(init)), []).append(name)
        found = [(n, None) for n in by_digest.get(digest, [])] + [(n, (1, 0)) for n in by_digest.get(digest_t, [])]
        if len(found) == 1:
            return (*found[0], digest, digest_t)
        if v.tesa.uniform != bits_of_dtype(v.dtype):
            where = f"several initializers hold it ({', '.join(n for n, _ in found)})" if found else \
                "no initializer of the exported file holds it"
            raise CaptureError(f"ONNX export of {graph.name!r}: cannot store the TeSA of weight {v.name!r}: {where}")
        return None

    read = {t for o in graph.ops() for t in o.inputs} | set(graph.outputs)
    for v in graph.tensors():
        dense = v.tesa.uniform == bits_of_dtype(v.dtype)
        if v.kind == "weight":   # every weight: its name survives whatever renames the file later
            if v.data is None or v.name not in read:
                continue
            found = locate(v)
            if found is None:
                continue
            init, perm, digest, digest_t = found
            record = {"kind": "weight", "initializer": init, "perm": perm, "sha256": digest, "sha256_t": digest_t,
                      "consumers": readers.get(init, []), "tesa": None if dense else v.tesa.to_json()}
        elif dense:
            continue
        elif v.name in graph.inputs or v.name in graph.outputs:
            kind = "input" if v.name in graph.inputs else "output"
            index = (graph.inputs if kind == "input" else graph.outputs).index(v.name)
            record = {"kind": kind, "index": index, "tesa": v.tesa.to_json()}
        else:
            skipped.append(v.name)
            continue
        record.update(format=FORMAT, shape=list(v.shape), dtype=str(v.dtype))
        prop = model.metadata_props.add()
        prop.key, prop.value = TESA_PREFIX + v.name, json.dumps(record)
    if aliases:
        prop = model.metadata_props.add()
        prop.key, prop.value = ALIASES_KEY, json.dumps(aliases)
    return skipped


# -- import -----------------------------------------------------------------------------------------
@dataclass
class ImportPlan:
    """What :func:`prepare` learnt from the file, applied to the imported graph by :func:`attach`."""

    records: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)
    parameters: list = field(default_factory=list)
    resolution: Resolution = field(default_factory=Resolution)
    dropped: dict = field(default_factory=dict)      # record name -> why it was not attached
    folded: list = field(default_factory=list)
    tied: dict = field(default_factory=dict)         # parameter -> the tied parameter claimed for it


def prepare(model: onnx.ModelProto, owned: bool, parameters=None) -> tuple[onnx.ModelProto, ImportPlan]:
    """Find the initializer of every stored weight TeSA and of every given parameter (splitting merged
    initializers); returns the model to import (a copy if it had to change) and the plan."""
    em = EditableModel(model, owned)
    plan = ImportPlan(folded=fold_identity_constants(em))
    for prop in em.model.metadata_props:
        if prop.key.startswith(TESA_PREFIX):
            name = prop.key[len(TESA_PREFIX):]
            try:
                record = json.loads(prop.value)
            except ValueError as exc:
                raise TeSAError(f"corrupt sparta record for {name!r} in the ONNX metadata: {exc}") from exc
            if record.get("format") != FORMAT:
                plan.dropped[name] = "written without identity information (re-export with this sparta)"
            else:
                plan.records[name] = record
        elif prop.key == ALIASES_KEY:
            plan.aliases = json.loads(prop.value)
    claims = [Claim(name, r["sha256"], r.get("sha256_t"), r["initializer"],
                    tuple(r["perm"]) if r.get("perm") else None, tuple(r.get("consumers", ())))
              for name, r in plan.records.items() if r["kind"] == "weight"]
    recorded = {c.name: c.digest for c in claims}
    for first, *others in _tied(_parameters(parameters)).values():
        digest, digest_t = digests(first[1])
        names = [n for n, _ in (first, *others) if recorded.get(n) != digest]  # sparta's own names need nothing
        if names:
            claims.append(Claim(names[0], digest, digest_t, scoped=True, also=tuple(names[1:])))
            plan.parameters += names
            plan.tied.update({n: names[0] for n in names[1:]})
    plan.resolution = resolve(em, claims) if claims else Resolution()
    _refuse_unidentified(plan)
    return em.model, plan


def _parameters(parameters) -> dict[str, torch.Tensor]:
    if parameters is None:
        return {}
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.state_dict()
    if not isinstance(parameters, Mapping):
        raise CaptureError(f"parameters must map names to tensors (a state_dict), got {type(parameters).__name__}")
    bad = [k for k, v in parameters.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CaptureError(f"parameters must map names to tensors; not so for {bad[:3]}")
    return dict(parameters)


def _tied(parameters: dict) -> dict:
    """Parameters grouped by the tensor they are (tied parameters share one)."""
    groups = {}
    for name, t in parameters.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        groups.setdefault(key, []).append((name, t))
    return groups


def _refuse_unidentified(plan: ImportPlan) -> None:
    res = plan.resolution
    weights = [n for n, r in plan.records.items() if r["kind"] == "weight"]
    lost = [n for n in weights if n in res.unmatched and plan.records[n]["tesa"] is not None]
    if lost:
        raise TeSAError("no initializer of the ONNX file holds the weights these TeSAs were computed for "
                        f"(changed or removed since export): {', '.join(lost)}")
    for name in weights:
        if name in res.unmatched or any(name == n for n, _ in res.errors):
            if plan.records[name]["tesa"] is None:
                plan.dropped[name] = "no initializer of the file could be identified as holding it"
    tesa_errors = [(n, m) for n, m in res.errors if plan.records.get(n, {}).get("tesa") is not None]
    if tesa_errors:
        raise TeSAError("cannot tell which ONNX initializer holds these weights, so their TeSAs cannot be "
                        "attached:\n" + "\n".join(f"  {n!r}: {m}" for n, m in tesa_errors))
    res.errors = [(n, m) for n, m in res.errors if n in plan.parameters]
    raise_errors(res, "these parameters (pass only the parameters you attach TeSAs to, or fix the names)")


def attach(graph: Graph, plan: ImportPlan) -> Graph:
    """Put the stored TeSAs, aliases and parameter names on the imported graph; fills ``meta['onnx_import']``."""
    res = plan.resolution
    report = {"tesas": {}, "aliases": {}, "split": res.split, "shared": {}, "dropped": dict(plan.dropped),
              "identities_folded": plan.folded, "tied_apart": res.tied_apart,
              "unmatched_parameters": [p for p in plan.parameters if plan.tied.get(p, p) in res.unmatched
                                       and p not in res.bindings]}
    set_by: dict[str, tuple[str, TeSA]] = {}
    for name, record in plan.records.items():
        tesa = None if record["tesa"] is None else TeSA.from_json(record["tesa"])
        if record["kind"] == "weight":
            binding = res.bindings.get(name)
            if binding is None:
                continue
            _address(graph, name, binding.initializer, binding.perm, report)
            if tesa is None:
                continue
            _put_weight(graph, name, binding, tesa, set_by)
            report["tesas"][name] = binding.initializer
        else:
            _put_io(graph, name, record, tesa, report)
    for alias, spec in plan.aliases.items():
        binding = res.bindings.get(spec["tensor"])
        if binding is None:
            report["dropped"][alias] = f"alias of {spec['tensor']!r}, whose initializer was not identified"
            continue
        perm = _compose(binding.perm, spec["perm"])
        _address(graph, alias, binding.initializer, perm, report)
    for name in plan.parameters:
        binding = res.bindings.get(name) or res.bindings.get(plan.tied.get(name, name))
        if binding is not None:
            _address(graph, name, binding.initializer, binding.perm, report)
            if any(not same_name(other, name) for other in binding.shared_with):
                report["shared"].setdefault(binding.initializer, []).append(name)
    graph.meta["onnx_import"] = report
    _warn(report, graph)
    return graph


def _address(graph, name, tensor, perm, report) -> None:
    """Make ``name`` reach ``tensor`` (an alias unless it is its own name)."""
    if name == tensor and perm is None:
        return
    if graph.has_tensor(name):
        report["dropped"][name] = f"the file has another tensor of that name; reach it as {tensor!r}"
        return
    graph.add_alias(name, tensor, perm)
    report["aliases"][name] = {"tensor": tensor, "perm": list(perm) if perm else None}


def _put_weight(graph, name, binding, tesa, set_by) -> None:
    perm = binding.perm
    if perm is not None:   # into the initializer's orientation (the weight is initializer.permute(perm))
        inverse = sorted(range(len(perm)), key=perm.__getitem__)
        tesa = TeSA(tesa.check_shape(tuple(graph.tensor(binding.initializer).shape[p] for p in perm), name)
                    .view().permute(inverse).contiguous(), _trusted=True)
    init = binding.initializer
    if init in set_by and set_by[init][1] != tesa:
        raise TeSAError(f"weights {set_by[init][0]!r} and {name!r} are one initializer {init!r} in the ONNX file "
                        "and their TeSAs differ; the file does not say which reader is whose")
    set_by[init] = (name, tesa)
    graph.set_tesa(init, graph.tesa(init).meet(tesa.check_shape(graph.tensor(init).shape, name)))


def _put_io(graph, name, record, tesa, report) -> None:
    names = graph.inputs if record["kind"] == "input" else graph.outputs
    index = record["index"]
    if index >= len(names):
        report["dropped"][name] = f"the file has no {record['kind']} {index}"
        return
    v = graph.tensor(names[index])
    if list(v.shape) != record["shape"] or str(v.dtype) != record["dtype"]:
        report["dropped"][name] = (f"{record['kind']} {index} is {tuple(v.shape)} {v.dtype} here, "
                                   f"{tuple(record['shape'])} {record['dtype']} at export")
        return
    graph.set_tesa(v.name, v.tesa.meet(tesa))
    report["tesas"][name] = v.name


def _compose(inner, outer):
    """``(t.permute(inner)).permute(outer)`` as one permutation of ``t``."""
    if inner is None:
        return outer
    if outer is None:
        return tuple(inner)
    return tuple(inner[p] for p in outer)


def _warn(report, graph) -> None:
    if report["dropped"]:
        names = ", ".join(list(report["dropped"])[:5])
        warnings.warn(f"ONNX import of {graph.name!r}: {len(report['dropped'])} stored TeSAs or names not attached "
                      f"({names}…); see graph.meta['onnx_import']['dropped']", stacklevel=5)
    if report["shared"]:
        lines = "; ".join(f"{init}: {', '.join(ps)}" for init, ps in report["shared"].items())
        warnings.warn(f"ONNX import of {graph.name!r}: these parameters are one initializer in the file (merged "
                      f"by the exporter, readers not attributable), so a TeSA on one applies to all: {lines}",
                      stacklevel=5)
    if report["tied_apart"]:
        lines = "; ".join(", ".join(f"{n} -> {i}" for n, i in held.items()) for held in report["tied_apart"].values())
        warnings.warn(f"ONNX import of {graph.name!r}: tied parameters are separate initializers in the file, so a "
                      f"TeSA set through one name reaches only that name's use: {lines}", stacklevel=5)
    if report["unmatched_parameters"]:
        names = ", ".join(report["unmatched_parameters"][:5])
        warnings.warn(f"ONNX import of {graph.name!r}: {len(report['unmatched_parameters'])} parameters are held by "
                      f"no initializer of the file, exactly or transposed ({names}…); they cannot be named",
                      stacklevel=5)
