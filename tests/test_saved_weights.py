"""Kernels-only saves (``compiled.save(dir, weights=False)``) and ``sparta.load(dir, weights=checkpoint)``."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from models import QKV
from safetensors import safe_open
from safetensors.torch import save_file

import sparta
from sparta import saved
from sparta.saved import SavedModelError


def _block_mask(shape, block, density, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(-(-shape[0] // block), -(-shape[1] // block), generator=g) < density
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


class Net(torch.nn.Module):
    """Embedding tied to the output head, a block-sparse and a fine-sparse linear, a LayerNorm; odd shapes."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(53, 128)
        self.fc1 = torch.nn.Linear(128, 260)
        self.ln = torch.nn.LayerNorm(260)
        self.fc2 = torch.nn.Linear(260, 131)
        self.head = torch.nn.Linear(128, 53, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.fc2(self.ln(torch.relu(self.fc1(h)))), self.head(h)


MASKS = {"fc1.weight": _block_mask((260, 128), 32, 0.25, 1), "fc2.weight": _block_mask((131, 260), 1, 0.03, 2)}


def _pruned(seed):
    """A fresh Net whose weights respect MASKS (random values elsewhere)."""
    torch.manual_seed(seed)
    model = Net().eval()
    with torch.no_grad():
        for name, mask in MASKS.items():
            model.get_parameter(name).mul_(mask)
    return model


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    model = _pruned(0)
    c = sparta.compile(model, MASKS, (torch.randint(0, 53, (2, 7)),), dismantle="tile")
    assert {type(m).__name__ for m in c.module_replacements().values()} >= {"SparseLinearCPU"}
    root = tmp_path_factory.mktemp("saves")
    c.save(root / "full")
    saved.save(c, root / "kernels", weights=False)
    return model, c, root


def _ids():
    return torch.randint(0, 53, (3, 5), generator=torch.Generator().manual_seed(7))


def _same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_kernels_only_folder_holds_no_weight_values(compiled):
    _, _, root = compiled
    with safe_open(str(root / "kernels" / "tensors.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(k.startswith(("graph/", "source/")) for k in keys), keys
    assert all(k.rsplit("_", 1)[-1] in ("C", "P", "I") for k in keys), keys       # index lists only
    assert (root / "kernels" / "tensors.safetensors").stat().st_size < 0.05 * \
        (root / "full" / "tensors.safetensors").stat().st_size
    manifest = json.loads((root / "kernels" / "sparta.json").read_text())
    records = {r["name"]: r for r in manifest["weights"]["graph"]}
    assert manifest["weights"]["kernels_only"] and set(records) >= {"fc1.weight", "fc2.bias", "ln.weight"}
    assert set(records["fc1.weight"]["masks"]) == {"fc1.weight"}
    tied = next(r for r in records.values() if r["name"] in ("emb.weight", "head.weight"))
    assert set(tied["names"]) == {"emb.weight", "head.weight"}
    with pytest.raises(SavedModelError, match="kernels only"):
        sparta.load(root / "kernels")


@pytest.mark.parametrize("form", ["module", "state_dict", "file", "shards", "folder"])
def test_kernels_only_round_trips_with_any_checkpoint_form(compiled, form, tmp_path):
    model, c, root = compiled
    full = sparta.load(root / "full")
    sd = model.state_dict()
    if form == "module":
        weights = model
    elif form == "state_dict":
        weights = dict(sd)
    else:
        names = [k for k in sd if k != "head.weight"]      # a tied weight saved once, as Hugging Face does
        save_file({k: sd[k] for k in names[:3]}, str(tmp_path / "a.safetensors"))
        save_file({k: sd[k] for k in names[3:]}, str(tmp_path / "b.safetensors"))
        if form == "file":
            save_file({k: sd[k] for k in names}, str(tmp_path / "one.safetensors"))
            weights = tmp_path / "one.safetensors"
        elif form == "shards":
            weights = [tmp_path / "a.safetensors", str(tmp_path / "b.safetensors")]
        else:
            weights = tmp_path
    loaded = sparta.load(root / "kernels", weights=weights)
    _same(loaded(_ids()), full(_ids()))
    _same(loaded(_ids()), c(_ids()))
    loaded.verify()


def _refused(root, weights, match):
    with pytest.raises(SavedModelError, match=match):
        sparta.load(root / "kernels", weights=weights)


def test_bad_checkpoints_are_refused_with_the_tensor_named(compiled, tmp_path):
    model, _, root = compiled
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    _refused(root, {k: v for k, v in sd.items() if k != "ln.bias"}, "no tensor 'ln.bias'")
    _refused(root, {**sd, "fc2.bias": torch.randn(130)}, r"'fc2.bias' is float32 \[130\]")
    _refused(root, {**sd, "fc2.bias": sd["fc2.bias"].double()}, "'fc2.bias' is float64")
    stray = sd["fc1.weight"].clone()
    stray[~MASKS["fc1.weight"]] = 0.5
    _refused(root, {**sd, "fc1.weight": stray}, "'fc1.weight' is non-zero at .* elements its compiled mask prunes")
    unpruned = Net().state_dict()                           # the dense model: pruned elements not zero
    _refused(root, unpruned, "non-zero at")
    _refused(root, 42, "weights must be")
    (tmp_path / "w.bin").write_bytes(b"\x80\x04")
    _refused(root, tmp_path / "w.bin", "safetensors only, never unpickled")
    save_file({"fc1.bias": sd["fc1.bias"]}, str(tmp_path / "x.safetensors"))
    save_file({"fc1.bias": sd["fc1.bias"]}, str(tmp_path / "y.safetensors"))
    _refused(root, tmp_path, "'fc1.bias' is in both")


def test_a_pruning_mask_in_the_checkpoint_must_be_the_compiled_one(compiled):
    """torch.nn.utils.prune's form: ``<name>_orig`` and ``<name>_mask``."""
    torch.manual_seed(3)
    model = Net().eval()
    torch.nn.utils.prune.custom_from_mask(model.fc1, "weight", MASKS["fc1.weight"])
    with torch.no_grad():
        model.fc2.weight.mul_(MASKS["fc2.weight"])
    _, _, root = compiled
    loaded = sparta.load(root / "kernels", weights=model)
    with torch.no_grad():
        want = model(_ids())
    for a, b in zip(loaded(_ids()), want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    other = Net().eval()
    torch.nn.utils.prune.custom_from_mask(other.fc1, "weight", _block_mask((260, 128), 32, 0.25, 9))
    with torch.no_grad():
        other.fc2.weight.mul_(MASKS["fc2.weight"])
    _refused(root, other, "fc1.weight_mask differs from the mask")


def test_new_values_with_the_same_masks_replace_a_full_saves_weights(compiled, tmp_path):
    """The prune/quantise feedback loop: a full save, a fine-tuned checkpoint with the same masks."""
    _, _, root = compiled
    tuned = _pruned(11)
    fresh = sparta.compile(tuned, MASKS, (torch.randint(0, 53, (2, 7)),), dismantle="tile")
    for where in ("full", "kernels"):
        loaded = sparta.load(root / where, weights=tuned.state_dict())
        _same(loaded(_ids()), fresh(_ids()))
    _refused(root, Net().state_dict(), "non-zero at")
    with pytest.raises(SavedModelError, match="non-zero at"):
        sparta.load(root / "full", weights=Net())


def test_weights_must_be_a_bool_when_saving(compiled, tmp_path):
    _, c, _ = compiled
    with pytest.raises(sparta.SpartaError, match="weights must be True or False"):
        saved.save(c, tmp_path / "x", weights="no")


def test_quantised_cpu_weights_are_quantised_at_load_as_compile_does(tmp_path):
    """int8 / int4 CPU kernels: the checkpoint holds float weights, quantised at load at the plan's scales."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.ReLU(), torch.nn.Linear(160, 40)).eval()
    mask = _block_mask((160, 96), 32, 0.4, 4)
    with torch.no_grad():
        model[0].weight.mul_(mask)
    bits = torch.where(mask, 8, 0).to(torch.uint8)
    tesa = {"0.weight": sparta.TeSA.from_bits(bits),
            "2.weight": sparta.TeSA.from_bits(torch.full((40, 160), 4, dtype=torch.uint8))}
    c = sparta.compile(model, tesa, (torch.randn(3, 96),), dismantle="tile")
    saved.save(c, tmp_path / "k", weights=False)
    c.save(tmp_path / "f")
    x = torch.randn(5, 96)
    _same([sparta.load(tmp_path / "k", weights=model)(x)], [sparta.load(tmp_path / "f")(x)])


def test_stacked_linears_take_their_parts_from_the_checkpoint(tmp_path, monkeypatch):
    """q/k/v-like sibling linears compiled for CUDA run as one stacked weight; a checkpoint holds the parts under
    the user's names. Loaded here (no GPU): the packed blocks equal the full save's."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path / "cache"))

    torch.manual_seed(0)
    model = QKV(256).half().eval()
    tesa = {f"{n}.weight": _block_mask((256, 256), 32, 0.2, i) for i, n in enumerate("qkv")}
    with torch.no_grad():
        for name, m in tesa.items():
            model.get_parameter(name).mul_(m)
    c = sparta.compile(model, tesa, (torch.randn(4, 32, 256).half(),), target="cuda")
    assert list(c.graph.stacked_weights) == ["q+k+v.weight", "q+k+v.bias"]
    c.save(tmp_path / "full")
    saved.save(c, tmp_path / "kernels", weights=False)
    full = sparta.load(tmp_path / "full")
    save_file(model.state_dict(), str(tmp_path / "ck.safetensors"))
    loaded = sparta.load(tmp_path / "kernels", weights=tmp_path / "ck.safetensors")
    a, b = full.module_replacements(), loaded.module_replacements()
    assert set(a) == set(b)
    for name, module in a.items():
        for buf, t in module.named_buffers():
            torch.testing.assert_close(dict(b[name].named_buffers())[buf], t, rtol=0, atol=0)
    for n in ("q+k+v.weight", "q+k+v.bias"):
        torch.testing.assert_close(loaded.graph.tensor(n).data, full.graph.tensor(n).data, rtol=0, atol=0)
    bad = dict(model.state_dict())
    bad["k.weight"] = torch.randn(256, 256).half()
    with pytest.raises(SavedModelError, match="'k.weight' is non-zero"):
        sparta.load(tmp_path / "kernels", weights=bad)
    assert Path(tmp_path / "kernels" / "tensors.safetensors").stat().st_size < 20000
