"""compiled.save(dir) / sparta.load(dir): round trips, hash checks, no pickle, allowlisted ops."""

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from models import MLP, QKV, SmallCNN, tiny_bert

import sparta
from sparta import TeSA
from sparta.graph_json import GraphFormatError, decode, encode, resolve_target, target_name
from sparta import saved_folder
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
    assert {m["type"] for m in manifest["modules"].values()} >= {"cpu_linear", "passthrough"}
    assert not list(Path(path).rglob("*.pt")) and not list(Path(path).rglob("*.pkl"))


def _tree(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def test_saving_again_replaces_and_refuses_foreign_folders(compiled_mlp, tmp_path):
    compiled_mlp.save(tmp_path / "m")
    compiled_mlp.save(tmp_path / "m")                      # an earlier save is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], "no temporary folders are left"
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(SavedModelError, match="not a saved sparta model"):
        compiled_mlp.save(foreign)
    assert (foreign / "cat.jpg").read_bytes() == b"meow", "nothing of the user's is lost"


def test_a_folder_with_its_own_sparta_json_is_not_a_save(compiled_mlp, tmp_path):
    thesis = tmp_path / "thesis"
    (thesis / "data").mkdir(parents=True)
    (thesis / "sparta.json").write_text('{"my": "config"}')
    (thesis / "thesis.tex").write_text("\\section{Results}")
    (thesis / "data" / "runs.csv").write_text("1,2,3")
    before = _tree(thesis)
    with pytest.raises(SavedModelError, match="not a saved sparta model"):
        compiled_mlp.save(thesis)
    assert _tree(thesis) == before


@pytest.mark.parametrize("extra", ["notes.txt", "kernels/notes.txt", "results/", "kernels/mine/"])
def test_an_earlier_save_holding_other_files_is_not_replaced(compiled_mlp, tmp_path, extra):
    path = Path(compiled_mlp.save(tmp_path / "m"))
    (path / extra).parent.mkdir(parents=True, exist_ok=True)
    if extra.endswith("/"):
        (path / extra).mkdir()
    else:
        (path / extra).write_text("mine")
    before = _tree(path)
    with pytest.raises(SavedModelError, match="not part of the saved sparta model"):
        compiled_mlp.save(path)
    assert _tree(path) == before


def test_saving_into_a_file_or_a_symbolic_link_is_refused(compiled_mlp, tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(SavedModelError, match="not a folder"):
        compiled_mlp.save(tmp_path / "file")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(SavedModelError, match="symbolic link"):
        compiled_mlp.save(tmp_path / "link")
    assert (tmp_path / "file").read_text() == "mine" and not any((tmp_path / "real").iterdir())


@pytest.fixture(scope="module")
def dense_mlp():
    """A model of compiled_mlp's input shape without kernel modules: another set of files to save."""
    torch.manual_seed(1)
    return sparta.compile(MLP(d_in=128, d_hidden=64, d_out=10).eval(), {}, (torch.randn(5, 128),))


def _resave_forever(models, dest, exchange: bool, saves):
    torch.set_num_threads(1)      # a forked child must not wait on the parent's OpenMP pool
    if not exchange:              # as on a file system without renameat2(RENAME_EXCHANGE)
        saved_folder._exchange = lambda a, b: False
    while True:
        for model in models:
            model.save(dest)
            saves.value += 1


def _which(path, models, x) -> int:
    """Which of ``models`` the save at ``path`` holds (by its output on ``x``)."""
    out = sparta.load(path)(x)
    matches = [i for i, m in enumerate(models) if torch.equal(out, m(x))]
    assert matches, "the folder holds neither the old nor the new save"
    return matches[0]


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_killed_resaves_leave_the_old_or_the_new_save(compiled_mlp, dense_mlp, tmp_path, exchange):
    """SIGKILL a process re-saving two models in turn at random moments: every time the folder loads as one
    of them, and the next save leaves no temporary folder behind. ``SPARTA_SAVE_KILLS`` sets the count."""
    models, dest, x = (compiled_mlp, dense_mlp), tmp_path / "m", torch.randn(5, 128)
    t0 = time.perf_counter()
    for model in models:
        model.save(dest)
    period = time.perf_counter() - t0
    rng, ctx = random.Random(0), multiprocessing.get_context("fork")
    for _ in range(int(os.environ.get("SPARTA_SAVE_KILLS", "12"))):
        saves = ctx.Value("i", 0, lock=False)
        child = ctx.Process(target=_resave_forever, args=(models, dest, exchange, saves))
        child.start()
        wanted = rng.randint(1, 2)          # kill during the save after the first or second (a load-proof clock)
        while saves.value < wanted and child.is_alive():
            time.sleep(0.001)
        time.sleep(rng.uniform(0, period / 2))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL and saves.value >= wanted, "the child saved until it was killed"
        _which(dest, models, x)
    compiled_mlp.save(dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def _save_and_die(model, dest, step: int, exchange: bool):
    """Save ``model`` to ``dest``, dying (as by SIGKILL) right after ``step`` renames of the replacement
    (0: before any), by ``renameat2`` exchange or, without it, in two renames."""
    torch.set_num_threads(1)
    real_rename, done = os.rename, []

    def rename(a, b):
        real_rename(a, b)
        done.append((a, b))
        if len(done) == step:
            os._exit(9)

    def exchange_then_die(a, b):
        assert real_exchange(a, b)
        os._exit(9)

    real_exchange = saved_folder._exchange
    os.rename = rename
    saved_folder._exchange = exchange_then_die if exchange else (lambda a, b: False)
    if step == 0:
        saved_folder._sync_tree = lambda root: os._exit(9)
    model.save(dest)
    os._exit(0)


@pytest.mark.parametrize("exchange, step", [(True, 0), (True, 1), (False, 1), (False, 2), (False, 3)])
def test_a_save_killed_at_each_step_of_a_replacement_is_recovered(compiled_mlp, dense_mlp, tmp_path, exchange, step):
    models, dest, x = (compiled_mlp, dense_mlp), tmp_path / "m", torch.randn(5, 128)
    compiled_mlp.save(dest)
    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(dense_mlp, dest, step, exchange))
    child.start()
    child.join()
    assert child.exitcode == 9
    expected = 0 if step == 0 or (not exchange and step == 1) else 1
    assert _which(dest, models, x) == expected       # the load moves a save set aside back where needed
    dense_mlp.save(dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert _which(dest, models, x) == 1


def test_cleaning_spares_the_temporary_folder_of_a_running_save(compiled_mlp, tmp_path):
    dest = tmp_path / "m"
    with saved_folder.TempFolder(dest) as running:
        (running.path / "tensors.safetensors").write_bytes(b"half written")
        compiled_mlp.save(dest)                       # cleans up before it saves: must leave `running` alone
        assert running.path.is_dir() and (running.path / "tensors.safetensors").is_file()
    compiled_mlp.save(dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


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
    for broken, match in ((dict(entry, tensors=entry["tensors"] + ["nope"]), "malformed kernel module"),
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


# TVM as if not installed: ``import tvm`` fails and ``importlib.util.find_spec("tvm")`` says None (what torch's own
# checks for optional modules ask)
NO_TVM = """import sys
for name in ("tvm", "tvm_ffi"):
    sys.modules[name] = None
"""


def test_cuda_model_saves_and_loads_without_tvm(cuda_mlp, tmp_path):
    """A model compiled for CUDA here (no GPU) saves; a fresh process that cannot import TVM loads it."""
    path = cuda_mlp[2].save(tmp_path / "cuda_model")
    linear = cuda_mlp[2].module_replacements()["linear"]      # its tile kernel, GEMV and tiles per bucket of rows
    folders = {p.parent for p in Path(path).rglob("*.cubin")}
    assert len(folders) == 1 + (linear.gemv is not None) + (linear.gemv1 is not None) + len(linear.buckets) >= 3, folders
    assert all(sorted(p.name for p in f.glob("*.cubin")) == ["kernel.sm_80.cubin", "kernel.sm_90.cubin"]
               for f in folders)
    code = f"""
{NO_TVM}import torch, sparta
m = sparta.load({str(path)!r})
print(sorted(type(k).__name__ for k in m.module_replacements().values()))
try:
    m(torch.randn(4096, 1024))
except sparta.SpartaError as e:
    print("refused:", e)
assert all(v is None for k, v in sys.modules.items() if k.startswith("tvm"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "['Passthrough', 'SparseLinearCUDA']" in out.stdout
    assert "refused:" in out.stdout and "compiled for CUDA" in out.stdout


def test_a_cpu_model_without_tvm_asks_for_trust_instead_of_loading_its_libraries(compiled_mlp, tmp_path):
    path = compiled_mlp.save(tmp_path / "m")
    code = f"""
{NO_TVM}import sparta
try:
    sparta.load({str(path)!r})
except sparta.SavedModelError as e:
    print("refused:", e)
assert all(v is None for k, v in sys.modules.items() if k.startswith("tvm"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "needs TVM" in out.stdout and "trust_kernels=True" in out.stdout


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


def _hugging_face(name):
    import transformers as tf
    torch.manual_seed(0)
    if name == "bert":
        return tiny_bert(layers=1)
    return tf.GPT2Model(tf.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=100, n_positions=64,
                                      use_cache=False)).eval()


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hugging_face_outputs_load_as_the_models_own_class(name, tmp_path):
    """A fresh process, transformers not yet imported, gets the model's output class back from the saved folder."""
    from safetensors.torch import save_file
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    compiled = sparta.compile(_hugging_face(name), {}, (ids,))
    expected = compiled(ids)
    path = compiled.save(tmp_path / name)
    save_file({"y": expected.last_hidden_state}, str(tmp_path / "expected.safetensors"))
    code = f"""import sys, torch, sparta
from safetensors.torch import load_file
assert "transformers" not in sys.modules
out = sparta.load({str(path)!r})(torch.tensor({ids.tolist()}))
print(type(out).__module__ + "." + type(out).__name__)
torch.testing.assert_close(out.last_hidden_state, load_file("expected.safetensors")["y"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cls = type(expected)
    assert out.stdout.strip() == f"{cls.__module__}.{cls.__name__}"
    assert cls.__module__ == "transformers.modeling_outputs"


@pytest.mark.parametrize("kind, keys, rebuilt", [
    ("BaseModelOutput", ["last_hidden_state"], True),
    ("BaseModelOutput", ["last_hidden_state", "not_a_field"], False),     # not the class's fields: a dict
    ("ModelOutput", ["last_hidden_state"], False),                          # defined elsewhere, imported there
    ("torch", ["last_hidden_state"], False),                                # not a class
    ("BaseModelOutput.__init__", ["last_hidden_state"], False)])
def test_only_output_classes_of_transformers_modeling_outputs_are_rebuilt(kind, keys, rebuilt):
    import transformers.modeling_outputs as outputs

    from sparta.graph_json import load_treespec
    leaf = {"type": None, "context": None, "children_spec": []}
    node = {"type": "transformers.modeling_outputs." + kind, "context": json.dumps(keys),
            "children_spec": [leaf] * len(keys)}
    back = torch.utils._pytree.tree_unflatten(list(range(len(keys))), load_treespec(json.dumps([1, node])))
    assert type(back) is (outputs.BaseModelOutput if rebuilt else dict)
    assert dict(back) == dict(zip(keys, range(len(keys))))


def test_a_loaded_model_verifies_against_its_source_graph(compiled_mlp, tmp_path):
    path = compiled_mlp.save(tmp_path / "m")
    loaded = sparta.load(path)
    assert loaded.source_graph is not None and loaded.source_graph.tesa("fc1.weight") == compiled_mlp.source_graph.tesa("fc1.weight")
    loaded.verify()
    manifest = json.loads((Path(path) / "sparta.json").read_text())
    value = next(v for v in manifest["graph"]["tensors"] if v["name"] == "fc3.weight")
    value["tesa"] = TeSA.pruned(tuple(value["shape"])).to_json()    # a propagated TeSA that prunes what matters
    (Path(path) / "sparta.json").write_text(json.dumps(manifest))
    with pytest.raises(sparta.VerificationError, match="only the initial TeSAs"):
        sparta.load(path).verify()


def test_a_cuda_model_with_stacked_linears_stores_their_weights_once(tmp_path, monkeypatch):
    """q/k/v-like linears compiled for CUDA run stacked; the saved source graph reads its q/k/v weights back as rows
    of the stacked weight (itself restored from the kernel's packed blocks), so the folder holds them once; a saved
    manifest whose rows point past the stacked weight is refused."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))

    torch.manual_seed(0)
    model = QKV(512).half().eval()
    tesa = {f"{n}.weight": _block_mask((512, 512), 32, 0.1, i) for i, n in enumerate("qkv")}
    compiled = sparta.compile(model, tesa, (torch.randn(4, 64, 512).half(),), target="cuda")
    assert list(compiled.graph.stacked_weights) == ["q+k+v.weight", "q+k+v.bias"]
    assert "runs linear, linear_1, linear_2 stacked as one linear (q+k+v.weight)" in compiled.plan_report()
    path = Path(compiled.save(tmp_path / "m"))
    from safetensors import safe_open
    with safe_open(str(path / "tensors.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith("source/") and n.endswith(".weight") for n in names), sorted(names)
    loaded = sparta.load(path)
    for i, n in enumerate("qkv"):
        want = (getattr(model, n).weight * tesa[f"{n}.weight"]).detach()
        torch.testing.assert_close(loaded.source_graph.tensor(f"{n}.weight").data.half(), want, rtol=0, atol=0)
    manifest = json.loads((path / "sparta.json").read_text())
    manifest["source"]["sliced"]["q.weight"][2] = 4096
    (path / "sparta.json").write_text(json.dumps(manifest))
    with pytest.raises(sparta.SavedModelError):
        sparta.load(path)
