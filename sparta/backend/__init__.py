"""Backends: the torch.fx GraphModule that runs a compiled graph."""

from .fx import to_graph_module

__all__ = ["to_graph_module"]
