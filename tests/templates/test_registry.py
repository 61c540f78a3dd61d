"""The kernel-family registry: every folder of ``sparta.templates`` is one registered family, and its name is its op,
its kernel module's family, its saved module type and the kernel name selection gives it."""

import pkgutil

import torch

import sparta.templates as templates
from sparta.errors import SpartaError
from sparta.saved import MODULE_TYPES
from sparta.templates import registry


def test_every_family_folder_is_one_registered_family():
    folders = sorted(m.name for m in pkgutil.iter_modules(templates.__path__) if m.ispkg)
    assert [f.name for f in registry.families()] == folders
    for f in registry.families():
        assert f.package == f"sparta.templates.{f.name}" and f.summary and set(f.targets) <= {"cuda", "cpu"}


def test_a_family_name_is_its_op_module_and_saved_type():
    for f in registry.families():
        cls = f.module_class()
        if cls is None:
            assert f.name not in MODULE_TYPES
            continue
        assert cls.kernel_family == f.name and callable(f.builder())    # every kernel module has its build
        assert hasattr(torch.ops.sparta, f.name)
        assert MODULE_TYPES[f.name].endswith(f":{cls.__name__}")


def test_gemm_rules_come_from_the_families_in_order():
    names = [fn.__name__ for fn in registry.rules("gemm_cuda")]
    assert names[:3] == ["not_a_gemm", "k_alignment", "bias_shape"] and names[-1] == "bsr_tile"
    assert names.index("w4a16_gemv") < names.index("w4a16_dense_tile") < names.index("w8a8_gemv")


def test_every_kernel_decision_has_its_table():
    assert [fn.__name__ for fn in registry.rules("gemm_cpu")] == ["int8_vendor", "cpu_linear"]
    assert [fn.__name__ for fn in registry.rules("norm_cuda")][-1] == "layer_norm"
    assert [fn.__name__ for fn in registry.rules("attention")] == ["sizes_only_mask"]
    table = registry.rules("gemm_cuda")
    guards = [fn.__name__ for fn in table if fn.__module__ == "sparta.codegen.select_cuda"]
    assert guards == ["not_a_gemm", "k_alignment", "bias_shape", "not_a_format_we_run"]
    assert [fn.__name__ for fn in table[:5]] == ["not_a_gemm", "k_alignment", "bias_shape", "fp8_weights",
                                                 "not_a_format_we_run"], "FP8 weights before the format guard"
    assert {fn.__module__.split(".")[2] for fn in table[5:]} == {"bsr_linear", "nm_linear", "w4a16_gemv", "w8a8_gemv"}


def test_an_unknown_family_is_named_in_the_error():
    try:
        registry.family("nope")
    except SpartaError as exc:
        assert "bsr_linear" in str(exc)
    else:
        raise AssertionError("an unknown family was accepted")
