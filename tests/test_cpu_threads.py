"""sparta's CPU kernels and torch share one thread pool: the kernels' parallel loops run on torch's OpenMP threads."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sparta
from sparta.runtime import cpu_threads

SCRIPT = textwrap.dedent("""
    import os, sys, torch, sparta
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).eval()
    keep = (torch.rand(32, 8) < 0.3).repeat_interleave(32, 0).repeat_interleave(32, 1)
    x = torch.randn(512, 256)
    compiled = sparta.compile(model, {"0.weight": keep}, (x,))
    model(x)                                          # torch's OpenMP pool is up
    before = len(os.listdir("/proc/self/task"))
    for _ in range(5):
        compiled(x); model(x)
    print(before, len(os.listdir("/proc/self/task")))
""")


def thread_counts(env: dict) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env={**os.environ, **env},
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    return before, after


@pytest.mark.skipif(cpu_threads.launcher() is None or os.cpu_count() < 2, reason="needs GNU OpenMP, cc and 2 cores")
def test_compiled_cpu_models_start_no_second_thread_pool(tmp_path):
    env = {"SPARTA_CACHE": str(tmp_path), "OMP_NUM_THREADS": "2"}
    before, after = thread_counts(env)
    assert after == before, "sparta's kernels started threads of their own beside torch's OpenMP pool"
    before, after = thread_counts({**env, "SPARTA_CPU_THREADS": "tvm"})
    assert after > before, "TVM's own pool (the opt-out) starts its workers: the check above can fail"


@pytest.mark.skipif(cpu_threads.launcher() is None, reason="needs GNU OpenMP and cc")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernels_on_torchs_pool_compute_the_same_at_any_thread_count(tmp_path, monkeypatch, threads):
    monkeypatch.setenv("SPARTA_CACHE", str(tmp_path))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(96, 320), torch.nn.GELU()).eval()
    keep = torch.rand(320, 96) < 0.2                         # fine-grained and block rows of odd sizes
    x = torch.randn(131, 96)
    compiled = sparta.compile(model, {"0.weight": keep}, (x,))
    assert "torch's OpenMP threads" in compiled.kernel_report()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            model[0].weight.mul_(keep)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(cpu_threads.torch_openmp() is None, reason="needs GNU OpenMP")
def test_launcher_built_by_racing_processes_is_whole_and_a_broken_one_is_rebuilt(tmp_path):
    code = ("import sys; from sparta.runtime import cpu_threads; omp = cpu_threads.launcher(); "
            "print(omp is not None and hasattr(omp, 'sparta_omp_parallel_launch'))")
    env = {**os.environ, "SPARTA_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1000:] for _, err in outs]
    results = {out.split()[-1] for out, _ in outs}
    if results == {"False"}:
        pytest.skip("no C compiler with -fopenmp")
    assert results == {"True"}, "a process loaded a launcher another was still writing"
    folder = next((tmp_path / "omp_launcher").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["launcher.so"], "a process left its build files"
    (folder / "launcher.so").write_bytes(b"not a library")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-1] == "True", out.stderr[-1000:]


def test_each_process_builds_the_launcher_from_files_of_its_own(tmp_path, monkeypatch):
    """The source, object and library a build writes carry the process id (racing processes must not share them)."""
    seen = []
    monkeypatch.setattr(cpu_threads, "_succeeds", lambda command: seen.append(command) or True)   # builds nothing
    monkeypatch.setattr(cpu_threads.os, "getpid", lambda: 4242)
    assert cpu_threads._build(tmp_path, Path("/nonexistent/libgomp.so.1")) is None
    files = {Path(a).name for command in seen for a in command if str(tmp_path) in a}
    assert files == {"launcher.4242.c", "launcher.4242.o", "launcher.4242.so"}, files
    assert not list(tmp_path.iterdir()), "a failed build leaves no file"
