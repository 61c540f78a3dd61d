"""The CUDA source TVM emits for the GPU fixtures and benchmark kernels is, byte for byte, the source they had when the
kernel families moved into their folders: ``cuda_sources.json`` holds the SHA-256 of each one's ``kernel.cu`` (named
as its folder under ``artifacts/cuda/``). TVM lowering only, no nvcc.

By default one fixture per template variant; ``SPARTA_ALL_SOURCES=1`` checks every kernel of the manifest (the fixtures
of ``tests/fixtures/cuda_specs.py`` and the benchmarks' builders; about 20 minutes on 2 cores)."""

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
from fixtures.cuda_specs import fixture_specs

from sparta.codegen.cuda_build import cuda_templates, tvm_source

MANIFEST = json.loads(Path(__file__).with_name("cuda_sources.json").read_text())["sources"]
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SAMPLE = ("t_odd_gelu",                          # bsr_linear, mma.sync: fp16, tanh GELU, odd M, ragged N and K
          "t_i8_odd_relu_q8",                    # W8A8, int8 codes out
          "t_w4_ragged_zero_relu",               # W4A16 block records with zero points
          "t_const_nobias",                      # the block table baked in as __constant__ data
          "t_pdl_i8_b64_square_relu_q8",         # programmatic dependent launch
          "t_stream_w4_zero",                    # the streaming grid
          "t_wg_k16_gelu_erf",                   # wgmma, exact GELU
          "t_ws_i8_ragged_relu",                 # warp-specialised, persistent
          "t_pp_i8_relu_q8",                     # ping-pong
          "t_w8g_odd_relu",                      # W8A8 GEMV, dp4a
          "t_w8g_sparse_m16_q8_late",            # W8A8 GEMV, tensor cores over the kept chunks
          "w4a16/t_m1_asym_g128_fold_nt3_ks5",   # W4A16 GEMV: folded scales, split K
          "t_ln_res_warp_both",                  # LayerNorm with the residual add, fp16 and int8 codes
          "t_q_cta",                             # the per-token quantiser, a CTA per row
          "cv_odd_s2_relu_res")                  # conv2d: implicit GEMM, stride, padding, residual


def digest(template, spec) -> str:
    return hashlib.sha256(tvm_source(template, spec).encode()).hexdigest()


def benchmark_specs() -> tuple[dict, dict]:
    """The benchmark builders' kernels (``w4a16/`` ones under that prefix) and the probe template they need."""
    sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "probes")]
    import build_cuda_kernels
    import build_w4a16_kernels
    from read_probe import ReadProbeSpec, read_probe
    specs = {**build_cuda_kernels.kernels(), **{f"w4a16/{n}": s for n, s in build_w4a16_kernels.kernels().items()}}
    return specs, {ReadProbeSpec: read_probe}


@pytest.mark.parametrize("name", SAMPLE)
def test_fixture_source_is_unchanged(name):
    spec = fixture_specs()[name]
    assert digest(cuda_templates()[type(spec)], spec) == MANIFEST[name]


@pytest.mark.skipif(os.environ.get("SPARTA_ALL_SOURCES") != "1", reason="set SPARTA_ALL_SOURCES=1 (about 20 minutes)")
def test_every_kernel_source_is_unchanged():
    bench, probes = benchmark_specs()
    specs, templates = {**fixture_specs(), **bench}, {**cuda_templates(), **probes}
    assert sorted(specs) == sorted(MANIFEST), "the manifest names every fixture and benchmark kernel"
    changed = [name for name, spec in specs.items() if digest(templates[type(spec)], spec) != MANIFEST[name]]
    assert not changed, f"{len(changed)} of {len(specs)} kernels emit other CUDA source: {changed[:20]}"
