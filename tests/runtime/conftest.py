"""On a machine with a GPU, a GPU test skipped because its fixture was not built fails instead (build them with
``python tests/fixtures/build_cuda.py``): a GPU run without fixtures must not pass."""

import pytest
import torch

from fixtures.artifacts import MISSING


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and torch.cuda.is_available() and isinstance(report.longrepr, tuple) \
            and str(report.longrepr[2]).startswith("Skipped: " + MISSING):
        report.outcome = "failed"
        report.longrepr = f"{report.longrepr[2][len('Skipped: '):]} (build it: python tests/fixtures/build_cuda.py)"
