"""The kernels the GPU fixtures run, asserted here at compile time (no GPU: TVM and nvcc build them): the same checks
``tests/runtime/`` makes on the saved folders on a GPU (``tests/fixtures/kernel_choices.py``)."""

import shutil

import pytest

from fixtures import cuda_specs_w4a16_dequant, kernel_choices, saved_models

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]

CASES = {
    "decode_w4a16": (saved_models.decode_w4a16, kernel_choices.check_decode_w4a16),
    "mlp_w4a16": (saved_models.mlp_w4a16, kernel_choices.check_mlp_w4a16),
    "decode_w8a8": (saved_models.decode_w8a8, kernel_choices.check_decode_w8a8),
    "pingpong_ffn": (saved_models.pingpong_ffn, kernel_choices.check_pingpong),
    "postln_fp16": (saved_models.postln_fp16, kernel_choices.check_postln),
    "tesa_w4a16": (saved_models.tesa_w4a16, kernel_choices.check_tesa_w4a16),
    "llama_generate": (saved_models.llama_generate, kernel_choices.check_llama_generate),
    "dense_rows": (saved_models.dense_rows_mlp, kernel_choices.check_dense_rows),
    "nm_mlp": (saved_models.nm_mlp, kernel_choices.check_nm_mlp),
    "fp8_mlp": (saved_models.fp8_mlp, kernel_choices.check_fp8_mlp),
    "w4_prefill": (cuda_specs_w4a16_dequant.w4_prefill_mlp, kernel_choices.check_w4_prefill),
}
STATIC = {"tesa_w4a16"}     # one row: a batch of one stays fixed


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_compiles_to_the_kernels_its_gpu_test_expects(name):
    build, check = CASES[name]
    model = build()
    check(model)
    assert ("any size" in model.shapes_line()) != (name in STATIC), model.shapes_line()
