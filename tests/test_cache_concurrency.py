"""The kernel and pipeline caches under concurrency and tampering: atomic publish (a lost race is a hit),
broken entries replaced under a lock, intact entries never deleted for an import error, and a cache
root that only its user may write."""

import multiprocessing
import os
import random
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparta.codegen import build, cache
from sparta.errors import CodegenError

COMPILE = """
import sys, torch, sparta
sys.path.insert(0, {tests!r})
from models import MLP
from safetensors.torch import save_file
torch.manual_seed(0)
model = MLP(d_in=64, d_hidden=128, d_out=16).eval()
x = torch.randn(3, 64)
outs = {{}}
for r in range({rounds}):      # each round another mask: every process races to build the same new kernels
    g = torch.Generator().manual_seed(r)
    mask = torch.zeros(128, 64, dtype=torch.bool)
    mask[:64, :32] = True
    tesa = {{"fc1.weight": mask, "fc2.weight": torch.rand(128, 128, generator=g) < 0.02}}
    compiled = sparta.compile(model, tesa, (x,), target="cpu")
    assert compiled.kernels, "the model must run TVM kernels"
    outs[f"y{{r}}"] = compiled(x)
save_file(outs, sys.argv[1])
"""
# compiles per process (the trust goal is 4 x 20: SPARTA_COMPILE_ROUNDS=20)
ROUNDS = int(os.environ.get("SPARTA_COMPILE_ROUNDS", "1"))


def test_processes_compiling_one_model_into_a_fresh_cache_agree(tmp_path):
    env = {**os.environ, "SPARTA_CACHE": str(tmp_path / "cache"), "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    code = COMPILE.format(tests=str(Path(__file__).parent), rounds=ROUNDS)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"y{i}.safetensors")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    outs = [load_file(str(tmp_path / f"y{i}.safetensors")) for i in range(4)]
    assert len(outs[0]) == ROUNDS
    for out in outs[1:]:
        for key, y in out.items():
            torch.testing.assert_close(y, outs[0][key], rtol=0, atol=0)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith((".tmp", ".old"))]


def _content(key: str, n: int) -> bytes:
    return (key * (1 + n % 7)).encode() * 512


def _read(path: Path | None) -> bytes | None:
    try:
        return None if path is None else path.read_bytes()
    except FileNotFoundError:             # another process invalidated the entry meanwhile
        return None


def _hammer(root: str, seed: int, rounds: int, errors: str) -> None:
    os.environ["SPARTA_CACHE"] = root
    rng = random.Random(seed)
    try:
        for i in range(rounds):
            key = f"k{rng.randrange(3)}"
            if rng.random() < 0.6:
                path = cache.store(key, "lib.bin", lambda p, k=key, i=i: p.write_bytes(_content(k, i)), {"round": i})
            else:
                path = cache.lookup(key, "lib.bin")
            data = _read(path)
            assert data is None or data.startswith(key.encode()) and len(data) % (512 * len(key)) == 0, \
                "an entry is whole and of its key"
            if rng.random() < 0.05:
                cache.invalidate(key)
    except BaseException:  # noqa: BLE001 - reported to the parent
        Path(errors).write_text(traceback.format_exc())
        raise


def test_stores_of_the_same_keys_from_several_processes_never_fail(tmp_path):
    root, ctx = tmp_path / "cache", multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(str(root), seed, 150, str(tmp_path / f"err{seed}")))
             for seed in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    errors = [f.read_text() for f in tmp_path.glob("err*")]
    assert not errors, errors[0]
    assert all(p.exitcode == 0 for p in procs)
    assert not [p for p in root.iterdir() if p.name.endswith((".tmp", ".old"))]


def test_a_lost_race_is_a_hit_and_a_broken_entry_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    first = cache.store("k", "lib.bin", lambda p: p.write_bytes(b"first"), {})
    again = cache.store("k", "lib.bin", lambda p: p.write_bytes(b"second"), {})   # another process lost the race
    assert again == first and first.read_bytes() == b"first"
    first.write_bytes(b"rotten")
    assert cache.lookup("k", "lib.bin") is None
    fixed = cache.store("k", "lib.bin", lambda p: p.write_bytes(b"third"), {})
    assert fixed.read_bytes() == b"third" and cache.lookup("k", "lib.bin") == fixed


def test_the_cache_root_must_be_the_users_own(tmp_path, monkeypatch):
    root = tmp_path / "fresh" / "cache"
    monkeypatch.setenv("SPARTA_CACHE", str(root))
    assert cache.cache_root() == root and root.stat().st_mode & 0o777 == 0o700
    root.chmod(0o777)
    with pytest.raises(CodegenError, match="writable by group or others"):
        cache.lookup("k", "kernel.so")
    root.chmod(0o700)
    if os.getuid() == 0:                     # only root can hand a folder to another user
        os.chown(root, 12345, 12345)
        with pytest.raises(CodegenError, match="belongs to another user"):
            cache.cache_root()


def test_a_missing_tvm_runtime_keeps_an_intact_cached_kernel(tmp_path, monkeypatch):
    from sparta.templates.cpu_linear import block_spec
    from sparta.templates.cpu_linear.block import block_linear
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    spec = block_spec.BlockLinearSpec(4, 8, 8, (4, 4), ((0,), (1,)), name="cache_probe")
    built = build.build_cpu(block_linear, spec)
    build._LOADED.clear()

    def no_runtime():
        raise CodegenError("compiling kernels needs TVM")
    monkeypatch.setattr(build, "runtime", no_runtime)
    with pytest.raises(CodegenError, match="needs TVM"):
        build.build_cpu(block_linear, spec)
    assert cache.lookup(built.key, "kernel.so") is not None, "the entry survives a failed import"
