"""sparta's kernels as ``torch.library`` custom ops: what torch.compile, torch.export and CUDA graphs see.

Each kernel family with a kernel module (``sparta.templates.registry``) is one op
``sparta::<family>(str kernel, Tensor[] inputs, Tensor[] weights) -> Tensor[]``:

* ``kernel`` names the kernel module that runs it (its specialised kernels: sparsity, bits, block lists), a static
  argument that Dynamo treats as a constant;
* ``inputs`` are the activations, already in the layout and dtype the kernel reads (a module's ``forward`` does the
  reshapes and casts around the op with torch ops, which Inductor fuses into their neighbours);
* ``weights`` are the module's packed weights, scales and bias, so tracing sees every tensor the kernel reads.

The fake implementation asks the module for its outputs' shapes and dtypes, as functions of the inputs' shapes (the
rows stay symbolic). Outputs are fresh tensors; the ops mutate nothing that a caller can see, but one:
``sparta::decode_attention_rope`` (a decode step's rotary embedding, cache write and attention in one pair of
launches) writes the static cache's keys, values and position counter, and its schema says so (``Tensor(a!)``), so
Inductor orders it against every other use of them and updates them in place.
"""

from __future__ import annotations

import copy
import itertools
import weakref

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from ..errors import SpartaError
from ..templates.registry import families

_modules: weakref.WeakValueDictionary[str, KernelModule] = weakref.WeakValueDictionary()
_serial = itertools.count()


def kernel_module(key: str) -> KernelModule:
    """The live kernel module a ``sparta::`` op call names."""
    module = _modules.get(key)
    if module is None:
        raise SpartaError(f"no live sparta kernel module {key!r}: the compiled model that owned it was freed "
                          "(keep it alive while a traced or exported graph of it runs)")
    return module


class KernelModule(torch.nn.Module):
    """Base of sparta's kernel modules: ``call_kernel(*inputs)`` runs the module's ``sparta::<kernel_family>`` op.

    A subclass sets ``kernel_family`` and ``weight_names`` (its buffers the kernel reads, ``None`` ones skipped) and
    implements ``launch(inputs)`` (the real kernel call, outside tracing) and ``fake(inputs)`` (empty
    outputs of the right shapes and dtypes)."""

    kernel_family: str = ""
    weight_names: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.kernel_key = ""

    def register_kernel(self, name: str) -> None:
        """Give this module the key its op calls carry (unique per module in this process)."""
        self.kernel_key = f"{name}#{next(_serial)}"
        _modules[self.kernel_key] = self

    def __deepcopy__(self, memo):
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for k, v in self.__dict__.items():
            object.__setattr__(clone, k, copy.deepcopy(v, memo))
        clone.register_kernel(self.kernel_key.split("#")[0])
        return clone

    def kernel_weights(self) -> list[torch.Tensor]:
        out = []
        for name in self.weight_names:     # a plain loop: Dynamo (torch 2.11) does not trace generator expressions
            t = self._buffers.get(name)
            if t is not None:
                out.append(t)
        return out

    def bind_weights(self, weights: list[torch.Tensor]) -> None:
        """Use the weight tensors an op call passed (the module's own unless a trace or export copied them)."""
        present = [n for n in self.weight_names if self._buffers.get(n) is not None]
        if len(present) != len(weights):
            raise SpartaError(f"sparta kernel {self.kernel_key!r}: {len(weights)} weight tensors, wants {len(present)}")
        for name, t in zip(present, weights):
            if self._buffers[name] is not t:
                self._buffers[name] = t

    def call_kernel(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """Run the module's op on ``inputs``. Outside any trace (plain tensors, no Dynamo, no dispatch mode) the
        op's implementation is called directly: the dispatcher's round trip is host time an eager call would pay
        for nothing (~20 µs a call)."""
        if outside_trace(inputs):
            return self.launch(list(inputs))
        op = getattr(torch.ops.sparta, self.kernel_family)
        return op(self.kernel_key, list(inputs), self.kernel_weights())

    def launch(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The kernel on real tensors, reading the module's weight buffers (an op call binds those it passed)."""
        raise NotImplementedError

    def fake(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError


def outside_trace(tensors) -> bool:
    """Whether a kernel call on ``tensors`` runs outside any trace (plain tensors, no Dynamo, no dispatch mode), where
    its implementation is called directly instead of through the dispatcher."""
    return not torch.compiler.is_compiling() and _current_dispatch_mode() is None \
        and all(type(t) is torch.Tensor for t in tensors)


def _launch(kernel: str, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    module = kernel_module(kernel)
    module.bind_weights(weights)
    return module.launch(inputs)


def _fake(kernel: str, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return kernel_module(kernel).fake(inputs)


# Defined through torch.library.Library rather than @custom_op: the dispatcher calls ``_launch`` directly, without
# custom_op's Python autograd wrapper and Dynamo guard around every call (measured: ~100 µs per call on BERT-base,
# doubling an eager forward); the kernels take no gradient.
_LIB = torch.library.Library("sparta", "DEF")
for _family in (f.name for f in families() if f.module):
    _LIB.define(f"{_family}(str kernel, Tensor[] inputs, Tensor[] weights) -> Tensor[]")
    _LIB.impl(_family, _launch, "CompositeExplicitAutograd")
    torch.library.register_fake(f"sparta::{_family}", _fake, lib=_LIB)


def _launch_rope(kernel: str, inputs: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
                 weights: list[torch.Tensor]) -> torch.Tensor:
    module = kernel_module(kernel)
    module.bind_weights(weights)
    return module.launch_rope(inputs, k, v, position)


def _fake_rope(kernel: str, inputs: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
               weights: list[torch.Tensor]) -> torch.Tensor:
    return kernel_module(kernel).fake_rope(inputs)


_LIB.define("decode_attention_rope(str kernel, Tensor[] inputs, Tensor(a!) k, Tensor(b!) v, Tensor(c!) position, "
            "Tensor[] weights) -> Tensor")
_LIB.impl("decode_attention_rope", _launch_rope, "CompositeExplicitAutograd")
torch.library.register_fake("sparta::decode_attention_rope", _fake_rope, lib=_LIB)


__all__ = ["KernelModule", "kernel_module", "outside_trace"]
