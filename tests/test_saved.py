"""compiled.save(dir) / sparta.load(dir): round trips, hash checks, no pickle, allowlisted ops."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import MLP, SmallCNN, tiny_bert

import sparta
from sparta import TeSA
from sparta.graph_json import GraphFormatError, decode, encode, resolve_target, target_name
from sparta.saved import SavedModelError


def _block_mask(shape, block, density, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(-(-shape[0] // block), -(-shape[1] // block), generator=g) < density
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


@pytest.fixture(scope="module")
def compiled_mlp():
    torch.manual_seed(0)
    model = MLP(d_in=128, d_hidden=256, d_out=10).eval()
    tesa = {"fc1.weight": TeSA.from_mask(_block_mask((256, 128), 32, 0.2, 1)),
            "fc2.weight": TeSA.from_mask(torch.rand(256, 256) < 0.03)}
    return sparta.compile(model, tesa, (torch.randn(5, 128),))


def test_cpu_model_round_trips(compiled_mlp, tmp_path):
    path = compiled_mlp.save(tmp_path / "mlp")
    loaded = sparta.load(path)
    x = torch.randn(5, 128)
    torch.testing.assert_close(loaded(x), compiled_mlp(x), rtol=0, atol=0)
    assert loaded.kernel_report() == compiled_mlp.kernel_report()
    assert loaded.plan_report() == compiled_mlp.plan_report()
    assert loaded.tesa("fc1.weight") == compiled_mlp.tesa("fc1.weight")
    loaded.verify()
    manifest = json.loads((Path(path) / "sparta.json").read_text())
    assert {m["type"] for m in manifest["modules"].values()} >= {"sparse_linear_cpu", "passthrough"}
    assert not list(Path(path).rglob("*.pt")) and not list(Path(path).rglob("*.pkl"))


def test_saving_again_replaces_and_refuses_foreign_folders(compiled_mlp, tmp_path):
    compiled_mlp.save(tmp_path / "m")
    compiled_mlp.save(tmp_path / "m")                      # an earlier save is replaced
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(SavedModelError, match="not a saved sparta model"):
        compiled_mlp.save(foreign)
    assert (foreign / "cat.jpg").read_bytes() == b"meow", "nothing of the user's is lost"


@pytest.mark.parametrize("victim", ["tensors.safetensors", "kernels"])
def test_altered_files_are_refused(compiled_mlp, tmp_path, victim):
    path = Path(compiled_mlp.save(tmp_path / "m"))
    target = path / victim if victim != "kernels" else next((path / "kernels").rglob("kernel.so"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(SavedModelError, match="altered"):
        sparta.load(path)


def test_missing_and_foreign_manifests(compiled_mlp, tmp_path):
    with pytest.raises(SavedModelError, match="no sparta.json"):
        sparta.load(tmp_path)
    path = Path(compiled_mlp.save(tmp_path / "m"))
    manifest = json.loads((path / "sparta.json").read_text())
    (path / "sparta.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(SavedModelError, match="newer sparta"):
        sparta.load(path)
    (path / "sparta.json").write_text(json.dumps({**manifest, "files": {**manifest["files"], "../x": "0"}}))
    with pytest.raises(SavedModelError, match="outside its folder"):
        sparta.load(path)


def test_malformed_module_entries_are_refused(compiled_mlp, tmp_path):
    path = Path(compiled_mlp.save(tmp_path / "m"))
    manifest = json.loads((path / "sparta.json").read_text())
    entry = manifest["modules"]["linear"]
    for broken, match in ((dict(entry, tensors=["nope"]), "malformed kernel module"),
                          (dict(entry, kernels=["../../elsewhere"]), "plain keys"),
                          (dict(entry, type="pickle"), "does not know")):
        manifest["modules"]["linear"] = broken
        (path / "sparta.json").write_text(json.dumps(manifest))
        with pytest.raises(SavedModelError, match=match):
            sparta.load(path)


def test_op_targets_come_from_an_allowlist(compiled_mlp, tmp_path):
    path = Path(compiled_mlp.save(tmp_path / "m"))
    manifest = json.loads((path / "sparta.json").read_text())
    manifest["graph"]["ops"][0]["target"] = "os::system.default"
    (path / "sparta.json").write_text(json.dumps(manifest))
    with pytest.raises(GraphFormatError, match="not one a saved model may call"):
        sparta.load(path)
    with pytest.raises(GraphFormatError, match="cannot save op target"):
        target_name(print)
    assert resolve_target(target_name(torch.ops.aten.linear.default)) is torch.ops.aten.linear.default


@pytest.mark.parametrize("value", [(1, 2.5, None), [float("inf"), -0.0, float("nan")], torch.float16,
                                   torch.channels_last, torch.strided, torch.device("cpu"), {"a": (True, "s")}])
def test_argument_encoding_round_trips(value):
    text = json.dumps(encode(value), allow_nan=False)
    back = decode(json.loads(text))
    if isinstance(value, list):
        assert back[0] == float("inf") and str(back[1]) == "-0.0" and back[2] != back[2]
    else:
        assert back == value and type(back) is type(value)


def test_unsavable_arguments_raise():
    with pytest.raises(GraphFormatError, match="cannot save an op argument"):
        encode(object())


@pytest.mark.parametrize("make", [lambda: (SmallCNN().eval(), (torch.randn(2, 3, 16, 16),), "fc.weight"),
                                  lambda: (tiny_bert(), (torch.randint(0, 100, (2, 12)),),
                                           "encoder.layer.0.intermediate.dense.weight")])
def test_models_without_kernels_round_trip(make, tmp_path):
    model, inputs, name = make()
    w = dict(model.named_parameters())[name]
    compiled = sparta.compile(model, {name: torch.rand(w.shape) < 0.5}, inputs)
    loaded = sparta.load(compiled.save(tmp_path / "m"))
    with torch.no_grad():
        for a, b in zip(torch.utils._pytree.tree_leaves(loaded(*inputs)),
                        torch.utils._pytree.tree_leaves(compiled(*inputs))):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.fixture(scope="module")
def cuda_mlp(tmp_path_factory):
    """(model, fc1 mask, compiled): an MLP whose first linear is 90% block-sparse, compiled for CUDA here."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARTA_CACHE", str(tmp_path_factory.mktemp("cuda_cache")))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
        mask = _block_mask((2048, 1024), 32, 0.1, 3)
        return model, mask, sparta.compile(model, {"0.weight": mask}, (torch.randn(4096, 1024),), target="cuda")


def test_cuda_model_saves_and_loads_without_tvm(cuda_mlp, tmp_path):
    """A model compiled for CUDA here (no GPU) saves; a fresh process that cannot import TVM loads it."""
    path = cuda_mlp[2].save(tmp_path / "cuda_model")
    cubins = sorted(p.name for p in Path(path).rglob("*.cubin"))
    assert cubins == ["kernel.sm_80.cubin", "kernel.sm_90.cubin"]
    code = f"""
import sys
class NoTVM:
    def find_spec(self, name, path=None, target=None):
        if name == "tvm" or name.startswith(("tvm.", "tvm_ffi")):
            raise ImportError("TVM is blocked in this test")
sys.meta_path.insert(0, NoTVM())
import torch, sparta
m = sparta.load({str(path)!r})
print(sorted(type(k).__name__ for k in m.module_replacements().values()))
try:
    m(torch.randn(4096, 1024))
except sparta.SpartaError as e:
    print("refused:", e)
assert not any(k.startswith("tvm") for k in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "['Passthrough', 'SparseLinearCUDA']" in out.stdout
    assert "refused:" in out.stdout and "compiled for CUDA" in out.stdout


def test_cuda_weights_only_kernels_read_are_restored_from_the_packed_blocks(cuda_mlp, tmp_path):
    model, mask, compiled = cuda_mlp
    path = Path(compiled.save(tmp_path / "m"))
    from safetensors import safe_open
    with safe_open(str(path / "tensors.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "graph/0.weight" not in names and "graph/2.weight" in names and "module/linear/wp" in names
    loaded = sparta.load(path)
    restored = loaded.graph.tensor("0.weight").data
    assert restored.dtype == torch.float32
    torch.testing.assert_close(restored, (model[0].weight * mask).half().float(), rtol=0, atol=0)


def test_output_classes_of_unknown_packages_come_back_as_dicts():
    from sparta.graph_json import load_treespec
    spec = torch.utils._pytree.tree_structure({"last_hidden_state": 0, "pooler_output": 1})
    text = torch.utils._pytree.treespec_dumps(spec).replace("builtins.dict", "nosuch.module.Output")
    back = load_treespec(text)
    assert torch.utils._pytree.tree_unflatten([1, 2], back) == {"last_hidden_state": 1, "pooler_output": 2}
