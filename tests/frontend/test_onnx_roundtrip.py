"""ONNX round trips keep every TeSA with the tensor it was computed for.

Tiny transformers models (2 layers, hidden 64) whose LayerNorm weights are all equal at init, so an
exporter that merges equal initializers merges them: one pruned LayerNorm element must stay on its own
LayerNorm, a block mask on its own linear (the exporters also transpose and rename those).
"""

import re
import warnings

import onnx
import pytest
import torch
from torch.utils import _pytree as pytree

import sparta
from sparta import CaptureError, TeSA, TeSAError

transformers = pytest.importorskip("transformers")
H, FFN = 64, 128


def token_ids(seed):
    return (torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(seed)),)


def image(seed):
    return (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed)),)


def tiny(kind):
    """A 2-layer model of the family and a function making its inputs from a seed."""
    torch.manual_seed(0)
    T = transformers
    common = dict(vocab_size=100, max_position_embeddings=64)
    if kind == "bert":
        model = T.BertModel(T.BertConfig(num_hidden_layers=2, hidden_size=H, num_attention_heads=2,
                                         intermediate_size=FFN, **common))
    elif kind == "distilbert":
        model = T.DistilBertModel(T.DistilBertConfig(n_layers=2, dim=H, n_heads=2, hidden_dim=FFN, **common))
    elif kind == "gpt2":
        model = T.GPT2Model(T.GPT2Config(n_layer=2, n_embd=H, n_head=2, n_inner=FFN, vocab_size=100,
                                         n_positions=64, use_cache=False))
    elif kind == "llama":
        model = T.LlamaModel(T.LlamaConfig(num_hidden_layers=2, hidden_size=H, intermediate_size=FFN,
                                           num_attention_heads=2, num_key_value_heads=2, use_cache=False, **common))
    elif kind == "vit":
        model = T.ViTModel(T.ViTConfig(num_hidden_layers=2, hidden_size=H, num_attention_heads=2,
                                       intermediate_size=FFN, image_size=16, patch_size=8))
        return model.eval(), image
    elif kind == "t5":
        model = T.T5EncoderModel(T.T5Config(num_layers=2, d_model=H, d_ff=FFN, num_heads=2, d_kv=32, vocab_size=100))
    elif kind == "bart":
        from transformers.models.bart.modeling_bart import BartEncoder
        model = BartEncoder(T.BartConfig(encoder_layers=2, d_model=H, encoder_ffn_dim=FFN, encoder_attention_heads=2,
                                         **common))
    return model.eval(), token_ids


def block_mask(shape, seed, block=32, keep=0.2):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(-(-shape[0] // block), -(-shape[1] // block), generator=g) < keep
    blocks[0, 0] = True
    return blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)[:shape[0], :shape[1]]


def masks_for(params: dict) -> dict:
    """Block masks on three linear weights (one at 8 bits) and one pruned LayerNorm element."""
    linears = [n for n, p in params.items() if p.dim() == 2 and "emb" not in n and "relative" not in n
               and "wte" not in n and "wpe" not in n and "pooler" not in n and "shared" not in n]
    norms = [n for n, p in params.items() if p.dim() == 1 and re.search(r"norm|(^|\.)ln_", n.lower())
             and n.endswith("weight")]
    assert len(linears) >= 6 and len(norms) >= 3
    assert all(torch.equal(params[n], params[norms[0]]) for n in norms), "LayerNorm weights equal at init"
    out = {n: TeSA.from_mask(block_mask(params[n].shape, i), bits=8 if i == 1 else 32)
           for i, n in enumerate([linears[1], linears[len(linears) // 2 + 1], linears[-1]])}
    keep = torch.ones(params[norms[len(norms) // 2]].shape, dtype=torch.bool)
    keep[3] = False
    out[norms[len(norms) // 2]] = TeSA.from_mask(keep)
    return out


def leaves(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


MODELS = ["bert", "distilbert", "gpt2", "llama", "vit", "t5", "bart"]


@pytest.mark.parametrize("kind", MODELS)
def test_to_onnx_from_onnx_keeps_every_weight_tesa_and_compiles_alike(tmp_path, kind):
    model, make_inputs = tiny(kind)
    x = make_inputs(0)
    graph = sparta.capture(model, x)
    params = {v.name: v.data for v in graph.tensors("weight") if v.is_parameter}
    tesas = masks_for(params)
    for name, tesa in tesas.items():
        graph.set_tesa(name, tesa)
    path = tmp_path / f"{kind}.onnx"
    sparta.to_onnx(graph, path)
    back = sparta.from_onnx(path, x)
    read = {t for o in graph.ops() for t in o.inputs}
    for name in params:
        if name in read:
            assert back.tesa(name) == graph.tesa(name), name     # the masked ones, and every other stays dense
    want = sparta.compile(model, tesas, x)
    got = sparta.compile(str(path), {}, x)
    # the user's masked weights run on kernels both ways (propagation may prune more on one graph than the other:
    # an ONNX LayerNormalization and torch's decomposition do not prove the same columns zero)
    masked = {n for n, t in tesas.items() if t.ndim == 2}
    ran = [{p.weight for p in c.plan.ops.values() if p.kind == "sparse"} for c in (want, got)]
    assert got.kernels and want.kernels and all(len(r & masked) == len(ran[0] & masked) for r in ran)
    fresh = make_inputs(7)                                        # not the inputs the export traced
    for a, b in zip(leaves(want(*fresh)), leaves(got(*fresh)), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def _export(model, x, path, exporter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(model, x, str(path), dynamo=True)   # the optimizer folds, renames and merges
        else:
            class Hidden(torch.nn.Module):                        # the TorchScript exporter wants plain outputs
                def __init__(self, inner):
                    super().__init__()
                    self.inner = inner

                def forward(self, x):
                    return self.inner(x, return_dict=False)[0]
            torch.onnx.export(Hidden(model), x, str(path), dynamo=False, opset_version=17)
    model.eval()


def _masked_reference(model, tesas, x):
    """The model itself with the masks applied to its parameters."""
    state = model.state_dict()
    masked = {n: state[n] * tesa.mask.to(state[n].dtype) for n, tesa in tesas.items()}
    return leaves(torch.func.functional_call(model, masked, x))


@pytest.mark.parametrize("kind, exporter", [("bert", "dynamo"), ("distilbert", "dynamo"), ("gpt2", "dynamo"),
                                            ("llama", "dynamo"), ("vit", "dynamo"), ("bart", "dynamo"),
                                            ("bert", "torchscript"), ("t5", "torchscript")])
def test_user_export_masks_attach_by_parameter_names(tmp_path, kind, exporter):
    model, make_inputs = tiny(kind)
    x = make_inputs(0)
    path = tmp_path / f"{kind}.onnx"
    _export(model, x, path, exporter)
    state = model.state_dict()
    tesas = masks_for({n: p for n, p in state.items() if p.is_floating_point()})
    if exporter == "torchscript":
        tesas = {n: t for n, t in tesas.items() if "pooler" not in n}
    if exporter == "dynamo":
        graph = sparta.from_onnx(path, x, parameters=state)
    else:
        graph = sparta.capture(str(path), x, parameters=state)
    for name, tesa in tesas.items():
        graph.set_tesa(name, tesa)
        assert graph.tesa(name) == tesa
    pruned_norm = next(n for n in tesas if tesas[n].ndim == 1)
    named = set(graph.meta["onnx_import"]["aliases"]) | set(graph.tensor_names())
    equal = [n for n in state if n != pruned_norm and n in named and torch.equal(state[n], state[pruned_norm])]
    assert equal
    for name in equal:   # the LayerNorm weights the exporter merged with the pruned one stay dense
        assert graph.tesa(name).is_dense, name
    from sparta.backend.fx import to_graph_module
    from sparta.compiled_model import masked_weights
    fresh = make_inputs(7)
    got = leaves(to_graph_module(graph, masked_weights(graph))(*fresh))
    want = _masked_reference(model, tesas, fresh)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)


class TwoNorms(torch.nn.Module):
    """Two LayerNorms (equal weights at init) after two linears, on (batch, tokens, 16) inputs."""

    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.ln1 = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
        self.fc2, self.ln2 = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.ln2(self.fc2(torch.relu(self.ln1(self.fc1(x)))))


def _two_norms_graph():
    model, x = TwoNorms().eval(), torch.randn(2, 3, 16)
    graph = sparta.capture(model, (x,))
    keep = torch.ones(16, dtype=torch.bool)
    keep[5] = False
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(0)) < 0.5
    tesas = {"ln1.weight": TeSA.from_mask(keep), "fc2.weight": TeSA.from_mask(mask, bits=8)}
    for name, tesa in tesas.items():
        graph.set_tesa(name, tesa)
    return model, x, graph, tesas


def _optimized(model: onnx.ModelProto) -> onnx.ModelProto:
    """What the exporter's optimizer does to a file: fold transposes into new initializers, merge equal ones."""
    import onnx_ir
    import onnxscript
    from onnx_ir.passes.common import DeduplicateInitializersPass
    ir_model = onnx_ir.from_proto(model)
    onnxscript.optimizer.optimize(ir_model)
    DeduplicateInitializersPass()(ir_model)
    return onnx_ir.to_proto(ir_model)


def test_renamed_transposed_and_merged_initializers_keep_their_tesas():
    model, x, graph, tesas = _two_norms_graph()
    optimized = _optimized(sparta.to_onnx(graph))
    names = {i.name for i in optimized.graph.initializer}
    assert "fc2.weight" not in names and "ln2.weight" not in names, "the optimizer renamed and merged"
    back = sparta.from_onnx(optimized, (x,))
    assert back.meta["onnx_import"]["split"], "ln1.weight was split off the merged LayerNorm weight"
    for name in ("fc1.weight", "fc2.weight", "ln1.weight", "ln2.weight", "ln1.bias"):
        assert back.tesa(name) == graph.tesa(name), name
    want = sparta.compile(model, tesas, (x,), propagate=False)
    got = sparta.compile(optimized, {}, (x,), propagate=False)
    fresh = torch.randn(2, 3, 16)
    torch.testing.assert_close(got(fresh), want(fresh), rtol=1e-5, atol=1e-5)


def test_merged_initializer_whose_readers_cannot_be_told_apart_is_refused():
    _, x, graph, _ = _two_norms_graph()
    optimized = _optimized(sparta.to_onnx(graph))
    for i, node in enumerate(optimized.graph.node):
        node.name = f"n{i}"                       # a tool that renames nodes loses what sparta recorded
    with pytest.raises(TeSAError, match="merged with other tensors"):
        sparta.from_onnx(optimized, (x,))


def test_changed_weights_are_refused_and_old_records_dropped():
    _, x, graph, _ = _two_norms_graph()
    model = sparta.to_onnx(graph)
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    init = next(i for i in changed.graph.initializer if i.name == "fc2.weight")
    init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * 2, "fc2.weight"))
    with pytest.raises(TeSAError, match="fc2.weight"):
        sparta.from_onnx(changed, (x,))
    legacy = onnx.ModelProto()
    legacy.CopyFrom(model)
    for prop in legacy.metadata_props:
        if prop.key == "sparta.tesa.fc2.weight":
            prop.value = '{"shape": [16, 16], "encoding": "uniform", "value": 0, "payload": ""}'
    with pytest.warns(UserWarning, match="not attached"):
        back = sparta.from_onnx(legacy, (x,))
    assert back.tesa("fc2.weight").is_dense
    assert back.tesa("ln1.weight") == graph.tesa("ln1.weight")


def test_input_tesas_travel_by_position_and_activation_tesas_are_rederived():
    _, x, graph, _ = _two_norms_graph()
    rows = torch.ones(2, 3, 16, dtype=torch.bool)
    rows[:, 1] = False
    graph.set_tesa(graph.inputs[0], TeSA.from_mask(rows))
    inner = next(o.outputs[0] for o in graph.ops("relu"))
    graph.set_tesa(inner, TeSA.from_mask(torch.rand(graph.tensor(inner).shape) < 0.5))
    with pytest.warns(UserWarning, match="1 intermediate activations"):
        model = sparta.to_onnx(graph)
    back = sparta.from_onnx(model, (x,))
    assert back.tesa(back.inputs[0]) == TeSA.from_mask(rows)
    assert all(v.tesa.is_dense for v in back.tensors("activation"))


def _two_matmuls(shared: bool):
    """``x @ A @ B`` where A and B hold equal values: one initializer read twice, or two; no module scopes."""
    from onnx import TensorProto, helper
    value = torch.randn(8, 8).numpy()
    inits = [onnx.numpy_helper.from_array(value, "A")] + ([] if shared else [onnx.numpy_helper.from_array(value, "B")])
    nodes = [helper.make_node("MatMul", ["x", "A"], ["h"]), helper.make_node("MatMul", ["h", "A" if shared else "B"],
                                                                              ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), torch.from_numpy(value)


def test_parameters_equal_to_several_initializers_are_refused():
    model, value = _two_matmuls(shared=False)
    with pytest.raises(CaptureError, match="several distinct initializers .*A, B"):
        sparta.from_onnx(model, parameters={"p.weight": value.T.clone(), "q.weight": value.T.clone()})
    with pytest.raises(CaptureError, match="p.weight"):
        sparta.from_onnx(model, parameters={"p.weight": value.clone()})


def test_parameters_merged_into_one_initializer_share_it_with_a_warning():
    model, value = _two_matmuls(shared=True)
    with pytest.warns(UserWarning, match="a TeSA on one applies to all"):
        graph = sparta.from_onnx(model, parameters={"p.weight": value.T.clone(), "q.weight": value.T.clone()})
    assert graph.resolve("p.weight") == graph.resolve("q.weight") == ("A", [1, 0])
    with pytest.raises(CaptureError, match="ONNX models"):
        sparta.capture(TwoNorms(), (torch.randn(2, 3, 16),), parameters={})


def test_tied_parameters_the_exporter_holds_apart_keep_their_names(tmp_path):
    """GPT-2's output layer is tied to its embedding; the exporter keeps the embedding and a transposed copy."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                                                 n_positions=64, use_cache=False)).eval()
    x = (torch.randint(0, 100, (2, 8)),)
    _export(model, x, tmp_path / "lm.onnx", "dynamo")
    with pytest.warns(UserWarning, match="reaches only that name's use"):
        graph = sparta.from_onnx(tmp_path / "lm.onnx", x, parameters=model.state_dict())
    assert graph.resolve("lm_head.weight")[1] == [1, 0] and graph.resolve("transformer.wte.weight")[1] is None
    mask = torch.rand(100, 32, generator=torch.Generator().manual_seed(0)) < 0.5
    graph.set_tesa("lm_head.weight", TeSA.from_mask(mask))
    from sparta.backend.fx import to_graph_module
    from sparta.compiled_model import masked_weights
    got = to_graph_module(graph, masked_weights(graph))(*x)[0]
    want = model.transformer(*x).last_hidden_state @ (model.lm_head.weight * mask).T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_compile_takes_parameters_for_a_user_export(tmp_path):
    """``sparta.compile(path, {user's names: masks}, x, parameters=model)`` equals compiling the module itself."""
    model, make_inputs = tiny("bert")
    x = make_inputs(0)
    path = tmp_path / "bert.onnx"
    _export(model, x, path, "dynamo")
    tesas = {n: t for n, t in masks_for(dict(model.state_dict())).items() if t.ndim == 2}
    from_file = sparta.compile(str(path), tesas, x, parameters=model)
    from_module = sparta.compile(model, tesas, x)
    assert len(from_file.kernels) == len(from_module.kernels) > 0
    fresh = make_inputs(5)
    torch.testing.assert_close(leaves(from_file(*fresh))[0], leaves(from_module(*fresh))[0], rtol=1e-4, atol=1e-5)
