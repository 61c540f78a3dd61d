"""Tampered saved models: each is refused with a SavedModelError that says what is wrong, and none
runs code from the folder or reads or writes outside it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import MLP, SmallCNN, tiny_bert
from safetensors.torch import load_file, save_file

import sparta
from sparta import TeSA
from sparta.codegen.cache import file_digest
from sparta.graph_json import resolve_target, target_name
from sparta.runtime.cuda import CudaRuntimeError, check_launch
from sparta.saved import SavedModelError

X = torch.randn(5, 64)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """(saved folder, compiled model): an MLP with CPU kernels (a block-sparse and a fine-grained linear)."""
    torch.manual_seed(0)
    mask = torch.zeros(128, 64, dtype=torch.bool)
    mask[:32, :32] = True
    tesa = {"fc1.weight": TeSA.from_mask(mask), "fc2.weight": TeSA.from_mask(torch.rand(128, 128) < 0.05)}
    compiled = sparta.compile(MLP(d_in=64, d_hidden=128, d_out=10).eval(), tesa, (X,))
    return Path(compiled.save(tmp_path_factory.mktemp("saved") / "m")), compiled


@pytest.fixture
def saved(original, tmp_path):
    """A fresh copy of the saved model to tamper with."""
    return Path(shutil.copytree(original[0], tmp_path / "m"))


def manifest(path: Path) -> dict:
    return json.loads((path / "sparta.json").read_text())


def write_manifest(path: Path, data: dict, rehash: bool = True) -> None:
    """Write a manifest as a tamperer would: with the files' hashes brought up to date."""
    if rehash and isinstance(data["files"], dict):
        data["files"] = {rel: file_digest(path / rel) for rel in data["files"] if (path / rel).is_file()}
    (path / "sparta.json").write_text(json.dumps(data))


def refused(path: Path, phrase: str, **kwargs) -> SavedModelError:
    with pytest.raises(SavedModelError, match=phrase) as info:
        sparta.load(path, **kwargs)
    return info.value


def kernel_library(path: Path) -> Path:
    return next((path / "kernels").rglob("kernel.so"))


@pytest.fixture(scope="module")
def evil_library(tmp_path_factory):
    """(library, marker): a shared library whose constructor creates the marker file."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    folder = tmp_path_factory.mktemp("evil")
    marker = folder / "constructor-ran"
    src = folder / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void evil(void) {\n'
                   f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("pwned", f); fclose(f); }}\n}}\n')
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "evil.so"), str(src)], check=True)
    return folder / "evil.so", marker


# ---- native code -----------------------------------------------------------------------------

def test_a_replaced_kernel_library_never_runs(saved, original, evil_library):
    library, marker = evil_library
    shutil.copy(library, kernel_library(saved))
    write_manifest(saved, manifest(saved))                   # hashes match the replacement
    loaded = sparta.load(saved)                              # CPU kernels come back from their specs
    torch.testing.assert_close(loaded(X), original[1](X), rtol=0, atol=0)
    assert not marker.exists(), "the library in the folder must not be loaded without trust_kernels"


def test_an_unlisted_kernel_library_is_refused(saved, evil_library):
    library, marker = evil_library
    so = kernel_library(saved)
    shutil.copy(library, so)
    data = manifest(saved)
    del data["files"][so.relative_to(saved).as_posix()]
    write_manifest(saved, data)
    refused(saved, "kernel.so is not listed in sparta.json")
    refused(saved, "not listed", trust_kernels=True)
    assert not marker.exists()


def test_trusted_kernels_load_from_the_folder(saved, original):
    loaded = sparta.load(saved, trust_kernels=True)
    folders = {s.folder for m in loaded.module_replacements().values() for s in getattr(m, "subs", [])}
    assert folders and all(f is not None and saved in f.parents for f in folders)
    torch.testing.assert_close(loaded(X), original[1](X), rtol=0, atol=0)


def test_a_truncated_trusted_library_is_refused_not_fatal(saved):
    so = kernel_library(saved)
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])
    write_manifest(saved, manifest(saved))
    refused(saved, "truncated", trust_kernels=True)


def test_out_of_range_kernel_specs_and_index_tensors_are_refused(saved):
    data = manifest(saved)
    sub = data["modules"]["linear"]["config"]["subs"][0]
    rows = sub["spec"]["$dict"]["rows"]["$tuple"]
    rows[0]["$tuple"][0] = -1                              # a block column before the weight: an out-of-bounds read
    write_manifest(saved, data)
    refused(saved, "out of range or malformed")
    rows[0]["$tuple"][0] = 0
    tensors = load_file(str(saved / "tensors.safetensors"))
    index = next(k for k in tensors if k.startswith("module/") and k.endswith(("_C", "_I", "_P")))
    tensors[index] = tensors[index] + 1000                   # block indices the kernel reads at run time
    save_file(tensors, str(saved / "tensors.safetensors"))
    write_manifest(saved, data)
    refused(saved, "does not match its spec")


# ---- files outside the folder ----------------------------------------------------------------

@pytest.mark.parametrize("victim", ["tensors.safetensors", "kernel folder", "sparta.json"])
def test_symbolic_links_are_refused(saved, tmp_path, victim):
    target = saved / "tensors.safetensors" if victim != "kernel folder" else kernel_library(saved).parent
    target = saved / "sparta.json" if victim == "sparta.json" else target
    outside = tmp_path / "outside"
    shutil.move(str(target), outside)
    target.symlink_to(outside)
    refused(saved, "symbolic link")


def test_listed_paths_stay_inside_the_folder(saved):
    data = manifest(saved)
    data["files"]["/etc/passwd"] = "0" * 64
    write_manifest(saved, data, rehash=False)
    refused(saved, "outside its folder")


@pytest.mark.parametrize("name", ["/etc/passwd", "../../sparta.json", "..", "sub/kernel.cubin"])
def test_cubin_names_stay_inside_the_kernel_folder(saved, tmp_path, name):
    launch = {"entry": "k", "name": "k", "grid": [1, 1, 1], "block": [32, 1, 1], "shared_bytes": 0, "args": [],
              "cubins": {"sm_90": {"file": name, "sha256": "0" * 64}}}
    folder = tmp_path / "kernel"
    folder.mkdir()
    (folder / "launch.json").write_text(json.dumps(launch))
    with pytest.raises(CudaRuntimeError, match="outside itself"):
        check_launch(folder)
    evil = saved / "kernels" / "evil"                         # the same folder inside a saved model
    shutil.copytree(folder, evil)
    data = manifest(saved)
    data["files"]["kernels/evil/launch.json"] = ""
    data["modules"]["linear"]["kernels"].append("evil")
    write_manifest(saved, data)
    refused(saved, "outside itself")


@pytest.mark.parametrize("launch", [{"grid": [0, 1, 1]}, {"args": [{"name": "X", "dtype": "object", "shape": []}]},
                                    {"shared_bytes": -1}, {"entry": None}])
def test_malformed_launch_specs_are_refused(tmp_path, launch):
    base = {"entry": "k", "name": "k", "grid": [1, 1, 1], "block": [32, 1, 1], "args": [], "cubins": {}}
    (tmp_path / "launch.json").write_text(json.dumps({**base, **launch}))
    with pytest.raises(CudaRuntimeError, match="malformed launch.json"):
        check_launch(tmp_path)


# ---- the graph: only pure tensor ops ---------------------------------------------------------

REFUSED_OPS = ["aten::from_file.default", "aten::fill_.Scalar", "aten::copy_.default", "aten::set_.source_Storage",
               "aten::resize_.default", "aten::_local_scalar_dense.default", "aten::item.default",
               "aten::as_strided.default", "aten::empty.memory_format", "aten::_copy_from.default",
               "aten::_nested_view_from_buffer.default", "prims::device_put.default", "os::system.default",
               "aten::resize.default", "aten::resize_as.default", "aten::resize_as_.default",
               "aten::set_.source_Tensor", "aten::empty_like.default", "aten::empty_strided.default", "aten::empty_permuted.default",
               "aten::new_empty.default", "aten::new_empty_strided.default", "prims::empty_strided.default"]


@pytest.mark.parametrize("name", REFUSED_OPS)
def test_ops_outside_the_allowlist_are_refused(name):
    with pytest.raises(SavedModelError, match="not one a saved model may call"):
        resolve_target(name)
    if name.startswith("aten::"):
        ns, rest = name.split("::")
        op = getattr(getattr(torch.ops.aten, rest.rsplit(".", 1)[0]), rest.rsplit(".", 1)[1])
        with pytest.raises(SavedModelError, match="cannot save op"):
            target_name(op)


def test_a_graph_reading_a_file_is_refused(saved, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's secret")
    data = manifest(saved)
    op = data["graph"]["ops"][-1]
    out = op["outputs"][0]
    # what the audit built: the model's output read from a file (and, shared, written back by fill_)
    op.update(target="aten::from_file.default", inputs=[], kwargs={"$dict": {}},
              args={"$tuple": [str(secret), True, 17]})
    data["graph"]["ops"].append({**op, "name": "fill", "target": "aten::fill_.Scalar", "inputs": [out],
                                 "outputs": [out + "_w"], "args": {"$tuple": [{"$ref": out}, 0.0]}})
    write_manifest(saved, data)
    refused(saved, "not one a saved model may call")
    assert secret.read_text() == "the user's secret"


def _output_through(data: dict, target: str, args) -> None:
    """Route the graph's first output through one more op, ``target(*args(pre))``, ``pre`` being what the output was."""
    graph = data["graph"]
    out = graph["outputs"][0]
    last = next(o for o in graph["ops"] if out in o["outputs"])
    last["outputs"] = ["pre" if n == out else n for n in last["outputs"]]
    value = next(v for v in graph["tensors"] if v["name"] == out)
    graph["tensors"].append({**value, "name": "pre", "kind": "activation"})
    args = args({"$ref": "pre"})
    graph["ops"].append({"name": "crafted", "op": target.split("::")[1].split(".")[0],
                         "inputs": [a["$ref"] for a in args if isinstance(a, dict)], "outputs": [out], "target": target,
                         "args": {"$tuple": args}, "kwargs": {"$dict": {}}, "source": "", "multi_output": False})


# ops whose output is memory they did not compute: what a model gets from them is whatever that memory held
UNCOMPUTED = {"aten::resize.default": lambda pre: [pre, [5, 1000]],
              "aten::resize_as.default": lambda pre: [pre, pre],
              "aten::resize_.default": lambda pre: [pre, [5, 1000]],
              "aten::set_.source_Tensor": lambda pre: [pre, pre],
              "aten::empty_like.default": lambda pre: [pre],
              "aten::new_empty.default": lambda pre: [pre, [5, 10]],
              "aten::empty_strided.default": lambda pre: [[5, 10], [10, 1]],
              "aten::empty.memory_format": lambda pre: [[5, 10]]}


def test_a_crafted_graph_op_is_loaded_as_data(saved, original):
    _output_through(data := manifest(saved), "aten::clone.default", lambda pre: [pre])
    write_manifest(saved, data)
    torch.testing.assert_close(sparta.load(saved)(X), original[1](X), rtol=0, atol=0)


@pytest.mark.parametrize("target", sorted(UNCOMPUTED))
def test_a_graph_returning_memory_it_did_not_compute_is_refused(saved, target):
    _output_through(data := manifest(saved), target, UNCOMPUTED[target])
    write_manifest(saved, data)
    error = refused(saved, "not one a saved model may call")
    assert target in str(error)


def _tiny(cls, config):
    torch.manual_seed(0)
    return cls(config).eval()


def _models():
    import transformers as tf
    ids = (torch.randint(0, 100, (2, 12)),)
    return {"mlp": lambda: (MLP().eval(), (torch.randn(3, 24),)),
            "cnn": lambda: (SmallCNN().eval(), (torch.randn(2, 3, 16, 16),)),
            "bert": lambda: (tiny_bert(), ids),
            "gpt2": lambda: (_tiny(tf.GPT2Model, tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                                               n_positions=64, use_cache=False)), ids),
            "llama": lambda: (_tiny(tf.LlamaModel, tf.LlamaConfig(
                num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=100, max_position_embeddings=64, use_cache=False)), ids),
            "vit": lambda: (_tiny(tf.ViTModel, tf.ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                            intermediate_size=128, image_size=32, patch_size=8)),
                            (torch.randn(2, 3, 32, 32),))}


@pytest.mark.parametrize("name", ["mlp", "cnn", "bert", "gpt2", "llama", "vit"])
def test_every_op_of_captured_models_is_allowed(name):
    model, inputs = _models()[name]()
    graph = sparta.capture(model, inputs)
    for op in graph.ops():
        assert resolve_target(target_name(op.target)) is op.target, op.target


# ---- the manifest --------------------------------------------------------------------------

@pytest.mark.parametrize("version, phrase", [(1.0, "must be an integer"), (True, "must be an integer"),
                                             ("4", "must be an integer"), (-7, "never written"), (0, "never written"),
                                             (99, "newer sparta")])
def test_format_versions_are_checked(saved, version, phrase):
    write_manifest(saved, {**manifest(saved), "version": version})
    refused(saved, phrase)


def test_a_version_older_than_the_features_used_is_refused(saved):
    data = manifest(saved)
    data["version"] = 3
    data["modules"]["linear"]["type"] = "w8a8_gemv"
    write_manifest(saved, data)
    refused(saved, "version 4 introduced")


def test_a_cuda_model_from_before_the_gelu_names_is_refused(saved):
    data = manifest(saved)
    data.update(version=5, target="cuda")      # its "gelu" kernels computed the tanh form
    write_manifest(saved, data)
    refused(saved, "name their GELUs differently")


def test_a_cpu_model_from_before_the_int4_packing_and_weight_only_int8_is_refused(saved):
    data = manifest(saved)
    spec = data["modules"]["linear"]["config"]["subs"][0]["spec"]["$dict"]     # specs are saved encoded
    data["version"] = 6
    spec["weight_bits"] = 4                                                     # its nibbles paired other rows
    write_manifest(saved, data)
    refused(saved, "packed their nibbles otherwise")
    spec.update(weight_bits=8, act_bits=32)
    write_manifest(saved, data)
    refused(saved, "version 7 introduced")


def test_stored_tensors_must_match_the_declared_shapes_and_dtypes(saved):
    tensors = load_file(str(saved / "tensors.safetensors"))
    name = next(k for k in tensors if k.startswith("graph/") and k.endswith("bias"))
    for changed, phrase in ((tensors[name].double(), "declares"), (tensors[name][:-1], "declares")):
        save_file({**tensors, name: changed}, str(saved / "tensors.safetensors"))
        write_manifest(saved, manifest(saved))
        refused(saved, phrase)
    save_file({**tensors, "graph/stowaway": torch.zeros(3)}, str(saved / "tensors.safetensors"))
    write_manifest(saved, manifest(saved))
    refused(saved, "does not name")


def test_output_structures_never_import_modules(saved, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "evil_outputs.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n"
                                              "class Output(dict): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    leaf = {"type": None, "context": None, "children_spec": []}
    enum_key = json.dumps([{"__enum__": True, "fqn": "evil_outputs:Output", "name": "A"}])
    specs = [({"type": "evil_outputs.Output", "context": '["y"]', "children_spec": [leaf]}, {"y"}),
             ({"type": "builtins.dict", "context": enum_key, "children_spec": [leaf]}, None),
             ({"type": "collections.defaultdict", "context": '["y"]', "children_spec": [leaf]}, {"y"})]
    for spec, keys in specs:
        data = manifest(saved)
        data["graph"]["meta"]["out_spec"] = json.dumps([1, spec])
        write_manifest(saved, data)
        out = sparta.load(saved)(X)
        assert (set(out) == keys) if keys else isinstance(out, tuple)
    defaultdict = {"type": "collections.defaultdict", "children_spec": [leaf],
                   "context": {"default_factory_module": "evil_outputs", "default_factory_name": "Output",
                               "dict_context": ["y"]}}
    data = manifest(saved)
    data["graph"]["meta"]["out_spec"] = json.dumps([1, defaultdict])
    write_manifest(saved, data)
    refused(saved, "malformed pytree spec")
    assert not marker.exists() and "evil_outputs" not in sys.modules


def _set(path, value):
    def apply(data):
        *keys, last = path
        for k in keys:
            data = data[k]
        data[last] = value
    return apply


@pytest.mark.parametrize("mutate, phrase", [
    (_set(["modules"], []), "'modules' has type list"),
    (_set(["graph"], "graph"), "'graph' has type str"),
    (_set(["files"], ["tensors.safetensors"]), "'files' has type list"),
    (_set(["target"], "gpu"), "unknown target"),
    (_set(["kernels"], ["row"]), "malformed kernel report"),
    (_set(["modules", "linear", "config"], {}), "kernel module 'linear' cannot be restored"),
    (_set(["modules", "linear", "tensors"], [7]), "tensors must be names"),
    (_set(["modules", "linear", "weight_name"], "nowhere"), "unknown weight"),
    (_set(["graph", "ops", 0], "op"), "malformed"),
    (_set(["graph", "ops", 0, "args"], {"$tuple": []}), "arguments name inputs"),
    (_set(["graph", "tensors", 0, "tesa"], {"payload": "!!"}), "malformed"),
    (_set(["graph", "tensors", 0, "shape"], "wide"), "malformed graph tensor list"),
    (_set(["graph", "meta", "input_leaves"], 5), "malformed input_leaves"),
    (_set(["graph", "meta", "input_ranges"], {"x": "all"}), "malformed input_ranges"),
    (_set(["graph", "format"], 2), "saved graph format"),
    (_set(["plan"], {"ops": 1}), "malformed"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_manifests_raise_saved_model_errors(saved, mutate, phrase):
    data = manifest(saved)
    mutate(data)
    write_manifest(saved, data)
    refused(saved, phrase)


def test_malformed_files_raise_saved_model_errors(saved):
    (saved / "tensors.safetensors").write_bytes(b"\xff" * 64)
    write_manifest(saved, manifest(saved))
    refused(saved, "not a valid safetensors file")
    (saved / "sparta.json").write_text("[" * 100000)
    refused(saved, "not valid JSON")
    (saved / "sparta.json").write_text(json.dumps({"my": "config"}))
    refused(saved, "not a saved sparta model")
