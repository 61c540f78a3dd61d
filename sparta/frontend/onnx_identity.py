"""Which ONNX initializer holds which weight, across an exporter's renames, transposes and deduplication.

A *claim* says "the weight ``name`` has these contents" (a SHA-256 of its values, and of its transpose
for 2-D weights); sparta's own export adds the initializer it saw holding the weight and the nodes that
read it. :func:`resolve` binds every claim to the initializer that holds exactly those contents (as
they are, or transposed) and is read where the weight was read:

- one claim, one candidate initializer: bound;
- an initializer that several claims match (an exporter merged equal weights into one) is split: each
  consumer is given to the claim that owns it — the nodes sparta recorded at export, or, for a user's
  parameters, the module scope the torch exporters record (``pkg.torch.onnx.name_scopes``, or the
  TorchScript exporter's ``/module/path/Op`` node names) — and each claim gets its own copy;
- where consumers cannot be attributed, a claim is bound by its recorded initializer name, or to the one
  shared initializer (reported as ``shared``); several distinct candidates raise :class:`CaptureError`.

Names alone never bind: a name only picks among initializers whose contents already match.
"""

from __future__ import annotations

import ast
import hashlib
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..errors import CaptureError

TRANSPOSE = (1, 0)
_OTHER, _UNKNOWN = "<other>", "<unknown>"


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and values (row-major)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def digests(t: torch.Tensor) -> tuple[str, str | None]:
    """Digest of ``t`` and of its transpose (2-D only)."""
    return tensor_digest(t), tensor_digest(t.T) if t.dim() == 2 else None


def initializer_tensor(init: onnx.TensorProto) -> torch.Tensor:
    """An initializer's values as a torch tensor (the importer reads them the same way)."""
    return torch.from_numpy(np.array(numpy_helper.to_array(init), copy=True))


@dataclass
class Claim:
    """A weight (by its name) whose initializer is to be found by its contents."""

    name: str
    digest: str
    digest_t: str | None = None
    initializer: str | None = None   # the initializer to_onnx saw holding it
    perm: tuple | None = None        # and how (the weight is ``initializer.permute(perm)``)
    consumers: tuple = ()            # the nodes that read that initializer in the exported file
    scoped: bool = False             # a user parameter: its consumers are found by module scope
    also: tuple = ()                 # other names of the same tensor (tied parameters)

    @property
    def names(self) -> tuple:
        return (self.name, *self.also)

    @staticmethod
    def module_depth_of(name: str, scope: str) -> int:
        """Length of the module path owning parameter ``name`` if it matches ``scope``, else -1."""
        module = name.rpartition(".")[0]
        return len(module) if _in_module(module, scope) else -1


@dataclass
class Binding:
    initializer: str
    perm: tuple | None
    shared_with: tuple = ()          # other claims bound to the same initializer


@dataclass
class Resolution:
    bindings: dict = field(default_factory=dict)     # claim name -> Binding
    unmatched: list = field(default_factory=list)    # claims no initializer holds
    split: dict = field(default_factory=dict)        # initializer -> {claim: copy}
    errors: list = field(default_factory=list)       # (claim, message): identity not established
    tied_apart: dict = field(default_factory=dict)   # tied claim -> {name: initializer} (held apart)


class EditableModel:
    """An ONNX model copied on its first edit (a caller's ModelProto is never changed)."""

    def __init__(self, model: onnx.ModelProto, owned: bool):
        self.model, self.owned = model, owned

    def edit(self) -> onnx.ModelProto:
        if not self.owned:
            copy = onnx.ModelProto()
            copy.CopyFrom(self.model)
            self.model, self.owned = copy, True
        return self.model

    def names(self) -> set[str]:
        g = self.model.graph
        out = {i.name for i in g.initializer} | {v.name for v in (*g.input, *g.output, *g.value_info)}
        return out | {o for n in g.node for o in n.output}


def fold_identity_constants(em: EditableModel) -> list[str]:
    """Identity nodes reading an initializer become initializers of their own (named by the output).

    The TorchScript exporter deduplicates equal parameters this way (``Identity(a.weight) -> b.weight``):
    folding gives each parameter back its own tensor and name."""
    g = em.model.graph
    inits = {i.name for i in g.initializer}
    outputs = {o.name for o in g.output}
    fold = [i for i, n in enumerate(g.node) if n.op_type == "Identity" and n.domain in ("", "ai.onnx")
            and n.input[0] in inits and n.output[0] not in outputs and n.output[0] not in inits]
    if not fold:
        return []
    g = em.edit().graph
    by_name = {i.name: i for i in g.initializer}
    folded = []
    for i in fold:
        node = g.node[i]
        copy = onnx.TensorProto()
        copy.CopyFrom(by_name[node.input[0]])
        copy.name = node.output[0]
        g.initializer.append(copy)
        by_name[copy.name] = g.initializer[-1]
        folded.append(copy.name)
    for i in reversed(fold):
        del g.node[i]
    return folded


def node_scope(node: onnx.NodeProto) -> str | None:
    """The module path a node was exported from, or None when the file does not say."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            return scopes[-2] if len(scopes) >= 2 else ""   # the last entry names the node itself
    if node.name.startswith("/"):
        return ".".join(node.name.split("/")[1:-1])
    return None


def _in_module(module: str, scope: str) -> bool:
    return scope == module or (bool(module) and scope.endswith("." + module))


def _subgraph_names(graph: onnx.GraphProto) -> set[str]:
    """Every name read by a node inside a subgraph (If / Loop / Scan bodies)."""
    names = set()
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                names |= {i for n in sub.node for i in n.input} | _subgraph_names(sub)
    return names


def resolve(em: EditableModel, claims: list[Claim]) -> Resolution:
    """Bind each claim to its initializer (splitting merged ones); see the module docstring."""
    g = em.model.graph
    res = Resolution()
    by_digest = defaultdict(list)
    for init in g.initializer:
        try:
            by_digest[tensor_digest(initializer_tensor(init))].append(init.name)
        except (TypeError, ValueError):   # an element type torch cannot hold: no weight is stored that way
            continue
    # candidates[claim] = {initializer: {perms}}; claimed_by[initializer] = [claims]
    candidates, claimed_by = {}, defaultdict(list)
    for c in claims:
        cand = defaultdict(set)
        for name in by_digest.get(c.digest, ()):
            cand[name].add(None)
        for name in by_digest.get(c.digest_t, ()) if c.digest_t else ():
            cand[name].add(TRANSPOSE)
        candidates[c.name] = cand
        for name in cand:
            claimed_by[name].append(c)
        if not cand:
            res.unmatched.append(c.name)
    readers = defaultdict(list)
    for idx, node in enumerate(g.node):
        for name in set(node.input):
            if name in claimed_by:
                readers[name].append(idx)
    opaque_reads = _subgraph_names(g) | {o.name for o in g.output}
    present = {n.name for n in g.node if n.name}
    recorded_present = any(name in present for c in claims for name in c.consumers)
    claim_of = {n: c.name for c in claims for n in c.names}
    owned: dict[str, dict[str, list[int]]] = {}   # initializer -> claim -> nodes it owns
    owning_names = defaultdict(set)               # initializer -> the names (of tied claims) that own it
    for init, cs in claimed_by.items():
        owners = defaultdict(list)
        for idx in readers[init]:
            who = _owner(g.node[idx], cs, recorded_present)
            owners[claim_of.get(who, who)].append(idx)
            if who in claim_of:
                owning_names[init].add(who)
        if init in opaque_reads:
            owners[_UNKNOWN].append(-1)
        owned[init] = owners
    bound: dict[str, list[str]] = defaultdict(list)   # claim -> initializers owned
    for init, owners in owned.items():
        positive = [c for c in owners if c not in (_OTHER, _UNKNOWN)]
        if not positive or (_UNKNOWN in owners and len(owners) > 1):
            continue
        if len(owners) == 1:
            bound[positive[0]].append(init)
            continue
        copies = _split(em, init, {c: owners[c] for c in positive}, candidates)
        res.split[init] = copies
        for c, copy in copies.items():
            bound[c].append(copy)
            candidates[c][copy] = candidates[c][init]
    shared = defaultdict(list)
    for c in claims:
        if c.name in res.unmatched:
            continue
        mine = bound.get(c.name, [])
        if len(mine) > 1 and _bind_tied_apart(em, c, mine, owning_names, candidates, res):
            continue
        if len(mine) > 1:
            res.errors.append((c.name, f"its values are held by several initializers ({', '.join(mine)}), "
                                       "each read where it is used"))
            continue
        init = mine[0] if mine else _fallback(c, candidates[c.name], owned, res)
        if init is None:
            continue
        if not mine and c.consumers and len(readers[init]) > len(c.consumers):
            res.errors.append((c.name, f"initializer {init!r} holds its values but is read by {len(readers[init])} "
                                       f"nodes (the weight by {len(c.consumers)} at export): it was merged with "
                                       "other tensors and the file does not say which reader is whose"))
            continue
        perms = candidates[c.name][init]
        if len(perms) > 1:
            if c.perm not in perms:
                res.errors.append((c.name, f"it equals its own transpose, so its orientation in initializer "
                                           f"{init!r} cannot be told"))
                continue
            perms = {c.perm}
        res.bindings[c.name] = Binding(init, next(iter(perms)))
        shared[init].append(c.name)
    for init, names in shared.items():
        if len(names) > 1:
            for n in names:
                res.bindings[n].shared_with = tuple(m for m in names if m != n)
    return res


def _bind_tied_apart(em: EditableModel, c: Claim, inits: list, owning_names: dict, candidates: dict,
                     res: Resolution) -> bool:
    """Tied parameters the file holds as several initializers (an embedding as it is, the tied output layer
    transposed), each read only where one of the names is used: bind each name to its own."""
    names = [owning_names[i] for i in inits]
    if any(len(n) != 1 for n in names) or len(set().union(*names)) != len(inits):
        return False
    if any(len(candidates[c.name][i]) > 1 for i in inits):
        return False
    held = {}
    for init, (name,) in zip(inits, names):
        perms = candidates[c.name][init]
        if init in c.names and init != name and name not in em.names():
            _rename(em, init, name)   # the exporter named it after the other use: free that name for its own
            candidates[c.name][name] = perms
            init = name
        res.bindings[name] = Binding(init, next(iter(perms)))
        held[name] = init
    res.tied_apart[c.name] = held
    return True


def _rename(em: EditableModel, old: str, new: str) -> None:
    """Rename an initializer everywhere the top-level graph names it."""
    g = em.edit().graph
    for v in (*g.initializer, *g.input, *g.output, *g.value_info):
        if v.name == old:
            v.name = new
    for node in g.node:
        for j, i in enumerate(node.input):
            if i == old:
                node.input[j] = new


def _owner(node: onnx.NodeProto, claims: list[Claim], recorded_present: bool) -> str:
    """The claim (for tied parameters: the name) a node reading a candidate initializer belongs to, or
    _OTHER / _UNKNOWN."""
    recorded = [c for c in claims if node.name and node.name in c.consumers]
    if len(recorded) == 1:
        return recorded[0].name
    if recorded:
        return _UNKNOWN
    scope = node_scope(node)
    scoped = [c for c in claims if c.scoped]
    if scope is not None and scoped:
        depth = {n: Claim.module_depth_of(n, scope) for c in scoped for n in c.names}
        deepest = max(depth.values())
        if deepest < 0:
            return _OTHER
        mine = [name for name, d in depth.items() if d == deepest]
        return mine[0] if len(mine) == 1 else _UNKNOWN
    # sparta listed the nodes reading its weights: a node it did not list reads something else
    return _OTHER if recorded_present and any(c.consumers for c in claims) else _UNKNOWN


def same_name(a: str, b: str) -> bool:
    """One name is the other, or ends with it after a dot (``model.fc.weight`` / ``fc.weight``)."""
    return a == b or a.endswith("." + b) or b.endswith("." + a)


def _fallback(c: Claim, cand: dict, owned: dict, res: Resolution) -> str | None:
    """A claim consumer attribution did not decide: the candidate of its (recorded) name, else the only
    candidate no other claim owns."""
    def others(i):
        return [o for o in owned.get(i, {}) if o not in (_OTHER, _UNKNOWN, c.name)]
    free = [i for i in cand if not others(i)]
    if c.initializer in free:
        return c.initializer
    def named_after(i):
        return any(same_name(i, n) for n in c.names)
    named = [i for i in cand if named_after(i) and all(named_after(o) for o in others(i))]
    if len(named) == 1:
        return named[0]
    if len(free) == 1:
        return free[0]
    if free:
        res.errors.append((c.name, f"several distinct initializers hold its values ({', '.join(sorted(free))}) "
                                   "and nothing in the file tells which one is it"))
    else:
        res.unmatched.append(c.name)
    return None


def _split(em: EditableModel, init: str, groups: dict, candidates: dict) -> dict[str, str]:
    """Give each claim its own copy of ``init``, read by the nodes it owns; returns claim -> copy."""
    g = em.edit().graph
    source = next(i for i in g.initializer if i.name == init)
    taken = em.names()
    listed_as_input = any(v.name == init for v in g.input)
    copies = {}
    for claim, nodes in groups.items():
        perms = candidates[claim][init]
        if claim == init and perms == {None}:
            copies[claim] = init          # the claim the exporter named the merged tensor after keeps it
            continue
        name = claim if perms == {None} else f"{claim}^T"
        while name in taken:
            name += "'"
        taken.add(name)
        copy = onnx.TensorProto()
        copy.CopyFrom(source)
        copy.name = name
        g.initializer.append(copy)
        if listed_as_input:
            info = next(v for v in g.input if v.name == init)
            g.input.append(onnx.helper.make_tensor_value_info(name, info.type.tensor_type.elem_type,
                                                              list(copy.dims)))
        for idx in nodes:
            node = g.node[idx]
            for j, i in enumerate(node.input):
                if i == init:
                    node.input[j] = name
        copies[claim] = name
    still_read = any(init in n.input for n in g.node) or init in _subgraph_names(g) or any(
        o.name == init for o in g.output)
    if not still_read:
        keep = [i for i in g.initializer if i.name != init]
        del g.initializer[:]
        g.initializer.extend(keep)
        keep_inputs = [v for v in g.input if v.name != init]
        del g.input[:]
        g.input.extend(keep_inputs)
    return copies


def raise_errors(res: Resolution, what: str) -> None:
    """Raise one CaptureError naming every claim whose identity could not be established."""
    if res.errors:
        lines = "\n".join(f"  {name!r}: {msg}" for name, msg in res.errors)
        raise CaptureError(f"cannot tell which ONNX initializer holds {what}:\n{lines}")
