"""Compiling a model created on the meta device (no checkpoint at compile time): the kernels-only folder is the one a
compile with the real (masked) weights writes, and ``sparta.load(dir, weights=checkpoint)`` runs it; whatever needs
weight values is refused, saying what to do."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import sparta
from sparta.meta_model import MetaModelError

transformers = pytest.importorskip("transformers")


def _llama(hidden=128, inter=352):
    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def _masks(model, block: int = 16) -> dict[str, torch.Tensor]:
    """One block in each block row and column of every decoder linear (~12%): no channel is pruned whole, so the
    plan shrinks nothing (shrunk weights are computed from values, which a kernels-only save cannot hold)."""
    out = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and "proj" in name:
            r, c = p.shape[0] // block, p.shape[1] // block
            grid = torch.zeros(r, c, dtype=torch.bool)
            i = torch.arange(max(r, c))
            grid[i % r, (i * 3) % c] = True
            out[name] = grid.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return out


IDS = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(2))


def _meta(dtype=torch.float32, **shape):
    with torch.device("meta"):
        return _llama(**shape).to(dtype)


def _real(dtype=torch.float32, block=16, **shape):
    """The model with real weights, masked; no kept weight exactly zero (an fp16 draw can round to 0, which a real
    compile reads as pruned: an element the meta compile cannot know)."""
    torch.manual_seed(0)
    model = _llama(**shape).to(dtype)
    with torch.no_grad():
        for name, mask in _masks(model, block).items():
            w = model.get_parameter(name)
            w.copy_(torch.where(mask & (w == 0), torch.full_like(w, 1e-3), w) * mask)
    return model


def _kernel_parts(folder: Path) -> dict:
    """What a kernels-only folder says about the kernels: the plan of every op with a weight, the kernel records,
    the kernel modules' configs, the weights' masks, the files of ``kernels/`` and their digests, the stored tensors.
    (Names of torch ops may differ: the meta capture's SDPA output is contiguous, the CPU's is not, so the meta graph
    has one more ``clone`` per layer; fused ops' placeholder modules and the kernels' notes name them.)"""
    manifest = json.loads((folder / "sparta.json").read_text())
    with safe_open(str(folder / "tensors.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return {"plan": {k: v for k, v in manifest["plan"]["ops"].items() if v.get("weight")},
            "kernels": _scrub(manifest["kernels"]), "weights": manifest["weights"],
            "modules": _scrub({k: v for k, v in manifest["modules"].items() if v.get("type") != "fused"}),
            "files": {k: v for k, v in manifest["files"].items() if k.startswith("kernels/")},
            "tensors": tensors}


def _scrub(x):
    """Without build times and cache hits, the names of the graph tensors a module reads and the kernels' notes (which name the torch
    ops fused into them)."""
    if isinstance(x, dict):
        return {k: _scrub(v) for k, v in x.items() if k not in ("build_s", "cached", "input_name", "input_names", "x_name", "gated_output",
                                                                 "note")}
    return [_scrub(v) for v in x] if isinstance(x, list) else x


def _same(a: dict, b: dict) -> None:
    ta, tb = a.pop("tensors"), b.pop("tensors")
    assert a == b
    assert sorted(ta) == sorted(tb)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=0, msg=k)


@pytest.fixture(scope="module")
def cpu_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta")
    meta = sparta.compile(_meta(), _masks(_meta()), (IDS,), target="cpu")
    real = sparta.compile(_real(), _masks(_meta()), (IDS,), target="cpu")
    assert meta.module_replacements(), "the plan gives the linears kernels"
    meta.save(root / "meta", weights=False)
    real.save(root / "real", weights=False)
    return meta, root / "meta", root / "real"


def test_meta_compile_writes_the_real_compiles_plan_and_kernels_cpu(cpu_folders):
    _, meta, real = cpu_folders
    _same(_kernel_parts(meta), _kernel_parts(real))


def test_meta_folder_loads_with_the_checkpoint_and_generates_the_masked_models_tokens(cpu_folders):
    _, meta, _ = cpu_folders
    model = _real()
    loaded = sparta.load(meta, weights=model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, model(IDS, use_cache=False).logits)
    prompt = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(7))
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(loaded.generate(prompt, **kw), model.generate(prompt, **kw))


def test_the_meta_compiled_model_holds_no_weights_and_says_how_to_load_it(cpu_folders, tmp_path):
    compiled, _, _ = cpu_folders
    for call in (lambda: compiled(IDS), lambda: compiled.save(tmp_path / "full"), compiled.verify,
                 lambda: compiled.generate(IDS, max_new_tokens=2)):
        with pytest.raises(MetaModelError, match=r"sparta.load\(dir, weights=checkpoint\)"):
            call()


@pytest.mark.parametrize("kwargs, what", [({"verify": True}, "verify=True"), ({"measure": True}, "measure=True"),
                                          ({"calibration": [(IDS,)], "quant_tolerance": 0.01}, "calibration")])
def test_what_needs_weight_values_is_refused(kwargs, what):
    with pytest.raises(MetaModelError, match=what):
        sparta.compile(_meta(), _masks(_meta()), (IDS,), **kwargs)


def test_quantised_meta_weights_and_prune_hooks_are_refused():
    masks = {n: sparta.TeSA.from_mask(m, bits=8) for n, m in _masks(_meta()).items()}
    with pytest.raises(MetaModelError, match="8 bits"):
        sparta.compile(_meta(), masks, (IDS,))
    model = _meta()
    torch.nn.utils.prune.identity(model.model.layers[0].mlp.up_proj, "weight")
    with pytest.raises(MetaModelError, match="prune"):
        sparta.compile(model, _masks(_meta()), (IDS,))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_meta_compile_writes_the_real_compiles_plan_and_kernels_cuda(tmp_path):      # CUDA kernels build; none run
    parts = []
    shape = {"hidden": 512, "inter": 1408}          # fp16 and this size: the H200 plan gives the linears kernels
    for which, model in (("meta", _meta(torch.float16, **shape)), ("real", _real(torch.float16, 32, **shape))):
        compiled = sparta.compile(model, _masks(_meta(**shape), 32), (IDS,), target="cuda")
        compiled.save(tmp_path / which, weights=False)
        parts.append(_kernel_parts(tmp_path / which))
    assert parts[0]["kernels"], "the plan gives the linears kernels"
    _same(*parts)


# ---- 4-bit weights: kernels from the meta model, scales fitted at load ------------------------------------------
W4_SHAPE = {"hidden": 512, "inter": 1408}        # the plans give these linears 4-bit kernels (CPU at one row)


def _w4_tesas(masked: bool = False, block: int = 16) -> dict:
    masks = _masks(_meta(**W4_SHAPE), block)
    return {n: sparta.TeSA.from_mask(m, bits=4) if masked else sparta.TeSA.dense(tuple(m.shape), 4)
            for n, m in masks.items()}


def _dense_real(dtype):
    torch.manual_seed(0)
    return _llama(**W4_SHAPE).to(dtype)


def _without_clips(parts: dict) -> dict:
    """The kernel parts with each plan's 4-bit clip ratios left out (a meta compile records none: fitted at load)."""
    for op in parts["plan"].values():
        for q in (op.get("weight_quant") or {}).values():
            q.pop("clip")
    return parts


def _w4_pair(tmp_path, target: str, dtype, ids, masked: bool = False, **kw):
    """(meta folder, real folder, the real model): both compiles of the 4-bit model saved kernels-only."""
    block = 16 if target == "cpu" else 32
    real_model = _real(dtype, block, **W4_SHAPE) if masked else _dense_real(dtype)
    for which, model in (("meta", _meta(dtype, **W4_SHAPE)), ("real", real_model)):
        compiled = sparta.compile(model, _w4_tesas(masked, block), (ids,), target=target, **kw)
        assert {k["bits"] for k in compiled.kernels} == {"W4A32" if target == "cpu" else "W4A16"}
        compiled.save(tmp_path / which, weights=False)
    return tmp_path / "meta", tmp_path / "real", real_model


def _check_w4_pair(meta: Path, real: Path, model, ids=None) -> None:
    a, b = _kernel_parts(meta), _kernel_parts(real)
    clips = [q["clip"] for op in a["plan"].values() for q in (op.get("weight_quant") or {}).values()]
    assert clips and all(c == [] or c == "eJwDAAAAAAE=" for c in clips), "the meta plan records no clip ratios"
    _same(_without_clips(a), _without_clips(b))
    la, lb = sparta.load(meta, weights=model.state_dict()), sparta.load(real, weights=model.state_dict())
    ma, mb = la.module_replacements(), lb.module_replacements()
    assert sorted(ma) == sorted(mb) and any(dict(m.named_buffers()) for m in ma.values())
    for op, module in ma.items():          # the load fits the scales by the compile's rule: the same packed tensors
        want = dict(mb[op].named_buffers())
        for name, t in module.named_buffers():
            assert torch.equal(t, want[name]), (op, name)
    if ids is not None:
        with torch.no_grad():
            torch.testing.assert_close(la(ids).logits, lb(ids).logits, rtol=0, atol=0)
        la.verify()


def test_4bit_meta_compile_loads_as_the_real_compile_cpu(tmp_path):
    ids = torch.randint(0, 200, (1, 1), generator=torch.Generator().manual_seed(4))
    meta, real, model = _w4_pair(tmp_path, "cpu", torch.float32, ids, dynamic=False)
    _check_w4_pair(meta, real, model, ids)
    torch.manual_seed(1)
    other = _llama(**W4_SHAPE)                             # another checkpoint: scales fitted to it, kernels verified
    sparta.load(meta, weights=other.state_dict()).verify()
    bad = {k: (v[:, :-16] if k.endswith("up_proj.weight") else v) for k, v in model.state_dict().items()}
    with pytest.raises(sparta.SavedModelError, match="up_proj"):
        sparta.load(meta, weights=bad)


def test_masked_4bit_meta_compile_refuses_nonzero_pruned_weights_cpu(tmp_path):
    ids = torch.randint(0, 200, (1, 1), generator=torch.Generator().manual_seed(4))
    meta, real, model = _w4_pair(tmp_path, "cpu", torch.float32, ids, masked=True, dynamic=False)
    _check_w4_pair(meta, real, model, ids)
    with pytest.raises(sparta.SavedModelError, match="non-zero"):
        sparta.load(meta, weights=_dense_real(torch.float32).state_dict())


def test_meta_weights_of_mixed_low_bits_are_refused():
    tesas = _w4_tesas()
    name = next(iter(tesas))
    bits = tesas[name].bits.clone()
    bits[:8] = 16
    tesas[name] = sparta.TeSA.from_bits(bits)
    with pytest.raises(MetaModelError, match="4 bits"):
        sparta.compile(_meta(**W4_SHAPE), tesas, (IDS,))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_4bit_meta_compile_loads_as_the_real_compile_cuda(tmp_path):       # W4A16 kernels build; none run
    meta, real, model = _w4_pair(tmp_path, "cuda", torch.float16, IDS)
    _check_w4_pair(meta, real, model)
    bad = {k: (v.float() if k.endswith("o_proj.weight") else v) for k, v in model.state_dict().items()}
    with pytest.raises(sparta.SavedModelError, match="o_proj"):
        sparta.load(meta, weights=bad)
