import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def cpu_profile_for_small_models(tmp_path_factory):
    """``compile(target="cpu")`` in the tests plans with the shipped profile less its measured kernel-call time:
    the tests compile models of a few dozen features, where sparta's module call (tens of µs) would keep every op
    on torch, and what they check is the kernels. Plan choice on the shipped profile itself is tested through
    ``transform`` and ``load_target`` (which read it directly) and measured by the benchmarks."""
    import json

    from sparta.passes.transform import load_profile
    data = load_profile("cpu").to_json()
    data.pop("kernel_call_us", None)
    path = tmp_path_factory.mktemp("profile") / "cpu-tests.json"
    path.write_text(json.dumps(data))
    before = os.environ.get("SPARTA_CPU_PROFILE")
    os.environ["SPARTA_CPU_PROFILE"] = str(path)
    yield path
    if before is None:
        os.environ.pop("SPARTA_CPU_PROFILE", None)
    else:
        os.environ["SPARTA_CPU_PROFILE"] = before
