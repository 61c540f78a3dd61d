"""A weight stacked from parts (sibling linears run as one, ``passes/simplify.fuse_sibling_linears``) whose value is
never held: its parts are concatenated when it is read."""

from __future__ import annotations

import torch

from .graph import Value
from .tesa import TeSA


class StackedValue(Value):
    """A weight stacked along its first dim from ``parts`` (sibling linears run as one): ``data`` concatenates them
    on each read and is never held, so a model's stacked weights cost no memory beside their parts. Setting
    ``data`` makes that tensor the one part."""

    def __init__(self, name: str, tesa: TeSA, parts, is_parameter: bool = False):
        self.parts = list(parts)
        shape = (sum(int(p.shape[0]) for p in self.parts), *self.parts[0].shape[1:])
        super().__init__(name, shape, self.parts[0].dtype, "weight", tesa, None, is_parameter)

    @property
    def data(self) -> torch.Tensor:
        return torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]

    @data.setter
    def data(self, value) -> None:
        if value is not None:
            self.parts = [value]

    @property
    def has_data(self) -> bool:
        return True

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Rows ``start:end`` of the value (one part's own tensor where they are one part's rows)."""
        first = 0
        for p in self.parts:
            if first <= start and end <= first + p.shape[0]:
                return p[start - first:end - first]
            first += p.shape[0]
        return self.data[start:end]

    def copy(self) -> StackedValue:
        return StackedValue(self.name, self.tesa, self.parts, self.is_parameter)


__all__ = ["StackedValue"]
