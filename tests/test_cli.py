"""``sparta`` on the command line: compile an ONNX file with TeSAs from a file, inspect and profile the saved model."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

import sparta
from sparta.cli import example_input, main, read_tesas

pytest.importorskip("tvm", reason="compiles CPU kernels")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def block_mask(n, k, seed):
    grid = torch.rand(n // 32, k // 32, generator=torch.Generator().manual_seed(seed)) < 0.4
    grid[0, 0] = True
    return grid.repeat_interleave(32, 0).repeat_interleave(32, 1)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("cli")
    graph = sparta.capture(MLP().eval(), (torch.randn(4, 64),))
    sparta.to_onnx(graph, root / "mlp.onnx")
    return root


def test_compile_inspect_profile(onnx_file, capsys):
    masks = onnx_file / "masks.safetensors"
    save_file({"up.weight": block_mask(128, 64, 1)}, str(masks))
    out = onnx_file / "out"
    assert main(["compile", str(onnx_file / "mlp.onnx"), "--tesa", str(masks), "-o", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "cpu_linear[" in printed and f"saved to {out}" in printed
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "target cpu" in printed and "cpu_linear[" in printed and "template" in printed
    report = onnx_file / "profile.json"
    assert main(["profile", str(out), "--reps", "2", "--json", str(report)]) == 0
    assert "forward as called" in capsys.readouterr().out
    ops = json.loads(report.read_text())["ops"]
    assert any(o["runs"].startswith("cpu_linear[") and o["measured_us"] > 0 for o in ops)


def test_tesa_files_bool_uint8_and_json(tmp_path):
    mask, bits = block_mask(64, 64, 2), torch.full((64, 64), 8, dtype=torch.uint8)
    bits[:, :32] = 0
    save_file({"a": mask, "b": bits}, str(tmp_path / "t.safetensors"))
    tesas = read_tesas(tmp_path / "t.safetensors")
    assert torch.equal(tesas["a"].mask, mask) and torch.equal(tesas["b"].bits, bits)
    (tmp_path / "t.json").write_text(json.dumps({"a": tesas["a"].to_json()}))
    assert read_tesas(tmp_path / "t.json")["a"] == tesas["a"]


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    save_file({"w": torch.randn(4, 4)}, str(tmp_path / "f.safetensors"))
    assert main(["compile", "m.onnx", "--tesa", str(tmp_path / "f.safetensors"), "-o", str(tmp_path / "o")]) == 1
    assert "bool masks" in capsys.readouterr().err
    assert main(["compile", "m.onnx", "--tesa", str(tmp_path / "f.npy"), "-o", str(tmp_path / "o")]) == 1
    assert ".safetensors or .json" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert "not a saved sparta model" in capsys.readouterr().err
    assert example_input("2x7:int64").shape == (2, 7) and example_input("3:float16").dtype == torch.float16
    with pytest.raises(sparta.SpartaError, match="2x128:int64"):
        example_input("2xq:int64")


@pytest.fixture(scope="module")
def saved_mlp(tmp_path_factory):
    torch.manual_seed(0)
    return sparta.compile(MLP().eval(), {}, (torch.randn(4, 64),)).save(tmp_path_factory.mktemp("cli") / "m")


def test_inspect_of_a_malformed_plan_says_so(saved_mlp, tmp_path, capsys):
    folder = tmp_path / "m"
    shutil.copytree(saved_mlp, folder)
    manifest = json.loads((folder / "sparta.json").read_text())
    for broken in ({"ops": 5}, {"ops": {"linear": "dense"}}, {"ops": {"linear": {}}}, {"static_scales": [1.0]}):
        (folder / "sparta.json").write_text(json.dumps({**manifest, "plan": {**manifest["plan"], **broken}}))
        assert main(["inspect", str(folder)]) == 1
        assert "plan or kernel report in sparta.json is malformed" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_profile_on_a_missing_cuda_device_says_so(saved_mlp, capsys):
    assert main(["profile", str(saved_mlp), "--device", "cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().err
    assert main(["profile", str(saved_mlp), "--device", "gpu"]) == 1
    assert "not a device" in capsys.readouterr().err


def test_profile_json_goes_into_a_new_folder(saved_mlp, tmp_path, capsys):
    report = tmp_path / "new" / "folder" / "profile.json"
    assert main(["profile", str(saved_mlp), "--reps", "1", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["ops"]
    (tmp_path / "taken").write_text("a file, not a folder")
    assert main(["profile", str(saved_mlp), "--reps", "1", "--json", str(tmp_path / "taken" / "p.json")]) == 1
    assert "cannot write the profile there" in capsys.readouterr().err
