"""benchmarks/bench_cnn_shrink.py on the CPU: a tiny torch.nn network, its JSON and the build/load path."""

import json

import pytest
from cnn_models import benchmark_module


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("bench_cnn_shrink")


def test_smoke_run_prints_times_and_ratios(bench, tmp_path):
    out = tmp_path / "r.json"
    result = bench.main(["--device", "cpu", "--smoke", "--no-compile", "--batch", "1", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    smoke = result["models"]["smoke"]
    assert smoke["shrunk_ops"] >= 2 and smoke["plan_est_us"] < smoke["plan_dense_us"]
    for row in smoke["batches"].values():
        assert row["sparta_us"] > 0 and row["dense_compile_us"] > 0 and row["sparta_vs_dense_compile"] > 0
        assert row["sparta_max_abs_diff"] < 1e-4


def test_pruning_takes_the_blocks_inner_convolutions(bench):
    model = bench.build_model("smoke", 0)
    pruned = bench.prune_model(model, 0.5)
    assert len(pruned) == 2 and all(len(idx) == 8 for idx in pruned.values())


def test_build_then_load(bench, tmp_path):
    bench.main(["--device", "cpu", "--smoke", "--build", str(tmp_path / "b")])
    result = bench.main(["--device", "cpu", "--smoke", "--no-compile", "--batch", "2", "--dir", str(tmp_path / "b")])
    assert result["models"]["smoke"]["shrunk_ops"] >= 2
