"""Propagation over random graphs with index inputs is sound: masking every tensor by its propagated TeSA
changes no output, on fresh inputs (fresh indices over their whole range), against the model with only the
initial TeSAs applied."""

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparta
from sparta.backend.fx import to_graph_module
from sparta.compiled_model import masked_weights
from sparta.compiler import attach_tesa
from sparta.passes import propagate

B, D, K, V, L = 3, 12, 4, 20, 5
LAYERS = ("linear", "relu", "gather", "index_select", "topk", "sort_head", "embedding", "table", "argmax_pick",
          "scatter_add", "residual", "masked_index")


class RandomNet(nn.Module):
    """A chain of layers drawn from LAYERS over ``h`` (B, D), reading ``ids`` (B, L) and ``idx`` (B, K)."""

    def __init__(self, layers: list[str], seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = layers
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in layers)
        self.back = nn.ModuleList(nn.Linear(K, D) for _ in layers)
        self.emb = nn.Embedding(V, D)
        self.table = nn.Parameter(torch.randn(V, D))
        self.register_buffer("cols", torch.randperm(D)[:K])

    def forward(self, x, ids, idx):
        h, prev = x, x
        for i, kind in enumerate(self.layers):
            h, prev = self.layer(i, kind, h, prev, ids, idx), h
        return h

    def layer(self, i, kind, h, prev, ids, idx):
        if kind == "linear":
            return self.lins[i](h)
        if kind == "relu":
            return torch.relu(h)
        if kind == "gather":
            return self.back[i](torch.gather(h, 1, idx))
        if kind == "index_select":
            return self.back[i](torch.index_select(h, 1, self.cols))
        if kind == "topk":
            return self.back[i](torch.topk(h, K).values)
        if kind == "sort_head":
            return self.back[i](torch.sort(h)[0][:, :K])
        if kind == "embedding":
            return h + self.emb(ids).sum(1)
        if kind == "table":
            return h * self.table[ids[:, 0]]
        if kind == "argmax_pick":
            return h + torch.gather(h, 1, h.argmax(1, keepdim=True))
        if kind == "scatter_add":
            return torch.zeros_like(h).scatter_add(1, idx, h[:, :K]) + h
        if kind == "residual":
            return h + prev
        if kind == "masked_index":
            return self.back[i](h[:, idx[0]])
        raise ValueError(kind)


def inputs(gen):
    return (torch.randn(B, D, generator=gen), torch.randint(0, V, (B, L), generator=gen),
            torch.randint(0, D, (B, K), generator=gen))


@st.composite
def models(draw):
    layers = draw(st.lists(st.sampled_from(LAYERS), min_size=2, max_size=6))
    seed = draw(st.integers(0, 10_000))
    model = RandomNet(layers, seed).eval()
    gen = torch.Generator().manual_seed(seed)
    names = [n for n, p in model.named_parameters() if p.dim() == 2]
    chosen = draw(st.lists(st.sampled_from(names), max_size=4, unique=True))
    tesa = {}
    for name in chosen:
        shape = dict(model.named_parameters())[name].shape
        kind = draw(st.sampled_from(["random", "rows", "cols"]))
        density = draw(st.sampled_from([0.1, 0.4, 0.8]))
        if kind == "random":
            mask = torch.rand(shape, generator=gen) < density
        elif kind == "rows":
            mask = (torch.rand(shape[0], 1, generator=gen) < density).expand(shape)
        else:
            mask = (torch.rand(1, shape[1], generator=gen) < density).expand(shape)
        tesa[name] = sparta.TeSA.from_mask(mask)
    return model, tesa, seed


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(models())
def test_propagation_over_random_graphs_with_index_inputs_is_sound(case):
    model, tesa, seed = case
    graph = attach_tesa(sparta.capture(model, inputs(torch.Generator().manual_seed(seed))), tesa)
    propagated = propagate(graph)
    given_model = to_graph_module(graph, masked_weights(graph))
    pruned_model = to_graph_module(propagated, masked_weights(propagated))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(6):
        x = inputs(gen)
        with torch.no_grad():
            torch.testing.assert_close(pruned_model(*x), given_model(*x), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"layers {model.layers}, TeSAs on {sorted(tesa)}: {m}")
