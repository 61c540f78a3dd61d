"""The package installs as one ``sparta`` namespace and imports light (no TVM, no ONNX)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_maps_folders_into_sparta_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("sparta-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        tops = {n.split("/")[0] for n in names}
        zf.extractall(tmp_path / "site")
    assert tops == {"sparta", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert "sparta/passes/propagate.py" in names and "sparta/passes/rules/matmul.py" in names
    out = subprocess.run([sys.executable, "-c", "import sparta.passes, sparta.codegen, sparta.templates; "
                          "print(sparta.passes.__file__)"], check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path / "site"), "PATH": ""}, cwd=tmp_path)
    assert out.stdout.strip().startswith(str(tmp_path / "site"))


def test_import_is_light():
    code = ("import sys, sparta, sparta.passes; "
            "bad = [m for m in ('tvm', 'onnx', 'onnxscript', 'transformers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_package_folder_is_in_pyproject():
    """A new kernel family's folder (or any package) ships: pyproject's package list names every folder with an
    ``__init__.py`` under the mapped top-level folders."""
    import tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            assert ".".join((package, *rel)) in listed, f"{init.parent} is not in pyproject's packages"
