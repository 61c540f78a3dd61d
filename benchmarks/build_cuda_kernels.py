"""Build sparta's CUDA kernels here (TVM + nvcc, no GPU needed) for the GPU machine, which has no TVM.

    python benchmarks/build_cuda_kernels.py [--only NAME ...]     # writes artifacts/cuda/<name>/

Each folder holds the CUDA source, cubins for sm_80 and sm_90 and launch.json; spec.json
records the kernel's spec. ``tests/runtime/`` and ``benchmarks/bench_cuda_*.py`` load them
on the GPU machine through ``sparta.runtime.cuda`` (cuda-bindings).
"""

from __future__ import annotations

import argparse
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from bench_cuda_layernorm import LN_SHAPES  # noqa: E402  (benchmarks/ is the script's folder)
from common import bench_mask  # noqa: E402
from sparta.codegen.cuda_build import build_cuda, save_dir
from sparta.codegen.specialize_cuda import int8_dense_tiles
from sparta.templates.cuda_bsr import TUNED_TILES, BsrSpec, bsr_linear
from sparta.templates.cuda_layernorm import LayerNormSpec, layer_norm_kernel, pick_threads
from sparta.templates.cuda_quant import QuantRowsSpec, quantize_rows_kernel
from sparta.templates.cuda_quant import pick_threads as pick_quant_threads
from sparta.templates.cuda_w8a8_gemv import W8A8GemvSpec, w8a8_gemv

FFN1, FFN2 = (4096, 3072, 768), (4096, 768, 3072)     # BERT-base FFN, 4096 tokens: (M, N, K)
DENSE_TILES = {"t128x128k32": dict(bn=128, bk=32, tm=128, warps_m=2, warps_n=2, stages=4),
               "t128x128k64": dict(bn=128, bk=64, tm=128, warps_m=2, warps_n=2, stages=3),
               "t128x256k32": dict(bn=256, bk=32, tm=128, warps_m=2, warps_n=4, stages=4),
               "t256x128k32": dict(bn=128, bk=32, tm=256, warps_m=4, warps_n=2, stages=3),
               "t128x128k32s3": dict(bn=128, bk=32, tm=128, warps_m=2, warps_n=2, stages=3),
               "t256x128k64": dict(bn=128, bk=64, tm=256, warps_m=4, warps_n=2, stages=3)}
SPARSE_TILES = {"b32_t128": dict(bn=32, bk=32, tm=128, warps_m=4, warps_n=1, stages=4),
                "b32_t256": dict(bn=32, bk=32, tm=256, warps_m=4, warps_n=1, stages=4),
                "b32_t64": dict(bn=32, bk=32, tm=64, warps_m=2, warps_n=1, stages=4),
                "b32_t128w2": TUNED_TILES[32],
                "b64_t128": TUNED_TILES[64],
                "b64_t256": dict(bn=64, bk=64, tm=256, warps_m=4, warps_n=1, stages=3),
                "b64_t64": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=3),
                "b64_t64s2": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=2),
                # streaming grid (templates/cuda_bsr_stream.py): CTA (m tile, group) runs the group's rows
                "b64_t128g12": dict(TUNED_TILES[64], groups=12),
                **{f"b64_t64s2g{g}": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=2, groups=g)
                   for g in (6, 8, 10, 12)},
                **{f"b64_t32s2g{g}": dict(bn=64, bk=64, tm=32, warps_m=1, warps_n=2, stages=2, groups=g)
                   for g in (4, 6)}}


# W8A8 (dtype="int8"): bk counts int8 elements, so bk=64 moves the bytes of the fp16 bk=32 tiles
INT8_TILES = {"i8_t128x128k64": dict(bn=128, bk=64, tm=128, warps_m=2, warps_n=2, stages=4),
              "i8_t128x128k128": dict(bn=128, bk=128, tm=128, warps_m=2, warps_n=2, stages=3),
              "i8_t128x256k64": dict(bn=256, bk=64, tm=128, warps_m=2, warps_n=4, stages=4),
              "i8_t256x128k64": dict(bn=128, bk=64, tm=256, warps_m=4, warps_n=2, stages=3),
              "i8_t128x64k128": dict(bn=64, bk=128, tm=128, warps_m=2, warps_n=2, stages=3),
              "i8_t64x128k128": dict(bn=128, bk=128, tm=64, warps_m=2, warps_n=2, stages=4),
              "i8_b32_t128": dict(bn=32, bk=32, tm=128, warps_m=2, warps_n=1, stages=4),
              "i8_b32_t256": dict(bn=32, bk=32, tm=256, warps_m=4, warps_n=1, stages=4),
              "i8_b64_t128": dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3),
              "i8_b64_t256": dict(bn=64, bk=64, tm=256, warps_m=4, warps_n=2, stages=3),
              **{f"i8_b64_t64s2g{g}": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=2, groups=g)
                 for g in (4, 6, 8, 12)},
              "i8_b64_t64s3g8": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=3, groups=8),
              "i8_b64_t128s2g4": dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=2, groups=4),
              "i8_b64_t32s2g4": dict(bn=64, bk=64, tm=32, warps_m=1, warps_n=2, stages=2, groups=4),
              "i8_b64_t64": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=3)}

# Hopper wgmma kernels (mma="wgmma", sm_90a): warps_m x warps_n count warpgroups of 128 threads
WG = dict(mma="wgmma")
WGP = dict(mma="wgmma", producer=True)
WGMMA_TILES = {"t128x128k64wg": dict(bn=128, bk=64, tm=128, warps_m=2, warps_n=1, stages=4, **WG),
               "t128x256k64wg": dict(bn=256, bk=64, tm=128, warps_m=2, warps_n=1, stages=4, **WG),
               "t128x192k64wg": dict(bn=192, bk=64, tm=128, warps_m=2, warps_n=1, stages=4, **WG),
               "t128x256k64wg2": dict(bn=256, bk=64, tm=128, warps_m=2, warps_n=2, stages=4, **WG),
               "t256x128k64wg": dict(bn=128, bk=64, tm=256, warps_m=4, warps_n=1, stages=4, **WG),
               "t128x128k32wg": dict(bn=128, bk=32, tm=128, warps_m=2, warps_n=1, stages=6, **WG),
               "t128x128k64wgs3": dict(bn=128, bk=64, tm=128, warps_m=2, warps_n=1, stages=3, **WG),
               "t128x256k32wg": dict(bn=256, bk=32, tm=128, warps_m=2, warps_n=1, stages=4, **WG),
               "t128x192k64wgs3": dict(bn=192, bk=64, tm=128, warps_m=2, warps_n=1, stages=3, **WG),
               "t64x256k64wg": dict(bn=256, bk=64, tm=64, warps_m=1, warps_n=1, stages=4, **WG),
               "b32_t64wg": dict(bn=32, bk=32, tm=64, warps_m=1, warps_n=1, stages=6, **WG),
               "b64_t64wg": dict(bn=64, bk=64, tm=64, warps_m=1, warps_n=1, stages=4, **WG),
               "b64_t128wgs3": dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=1, stages=3, **WG),
               "b32_t128wg": dict(bn=32, bk=32, tm=128, warps_m=2, warps_n=1, stages=6, **WG),
               "b32_t256wg": dict(bn=32, bk=32, tm=256, warps_m=4, warps_n=1, stages=6, **WG),
               "b64_t128wg": dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=1, stages=4, **WG),
               "b64_t256wg": dict(bn=64, bk=64, tm=256, warps_m=4, warps_n=1, stages=4, **WG)}
# W8A8 tiles also built with the requantising epilogue (out="int8": the codes a W8A8 reader takes), "<tile>_q8"
INT8_Q8_TILES = ("i8_t128x128k64", "i8_t128x256k128wg", "i8_t128x192k128wg", "i8_t128x128k128wg", "i8_b32_t128",
                 "i8_b64_t128", "i8_b64_t64s2g4", "i8_b64_t64s2g6", "i8_b64_t64s2g8", "i8_b64_t64s2g12",
                 "i8_b64_t64s3g8", "i8_b64_t128s2g4", "i8_t128x192k128wgs5", "i8_t128x256k128pp", "i8_t128x192k128p",
                 "i8_t128x128k64wgs6", "i8_b64_t64", "i8_b64_t128wg", "i8_t128x128k64pp2", "i8_t64x192k64pp2",
                 "i8_t128x128k128pp2", "i8_t64x192k128pp2", "i8_b64_t128pp2", "i8_b64_t64pp2")
# built with int8 output only (the fp16 output tile does not fit in shared memory beside their stages)
# the one-tile mma.sync W8A8 tiles of the 90% picks, also built for programmatic dependent launch: "<tile>_pdl[_q8]"
INT8_PDL_TILES = ("i8_b64_t128", "i8_b64_t64")
INT8_Q8_ONLY = ("i8_t128x128k64pp2s10", "i8_t128x128k128pp2s5", "i8_t128x192k128pp2", "i8_t128x192k64pp2")
INT8_WGMMA_TILES = {"i8_t128x128k128wg": dict(bn=128, bk=128, tm=128, warps_m=2, warps_n=1, stages=4, **WG),
                    "i8_t128x256k128wg": dict(bn=256, bk=128, tm=128, warps_m=2, warps_n=2, stages=4, **WG),
                    "i8_t128x192k128wg": dict(bn=192, bk=128, tm=128, warps_m=2, warps_n=1, stages=4, **WG),
                    "i8_t256x128k128wg": dict(bn=128, bk=128, tm=256, warps_m=4, warps_n=1, stages=4, **WG),
                    "i8_t128x128k128wgs3": dict(bn=128, bk=128, tm=128, warps_m=2, warps_n=1, stages=3, **WG),
                    "i8_t128x256k64wg2": dict(bn=256, bk=64, tm=128, warps_m=2, warps_n=2, stages=4, **WG),
                    "i8_t128x192k128wgs3": dict(bn=192, bk=128, tm=128, warps_m=2, warps_n=1, stages=3, **WG),
                    "i8_t256x128k64wg": dict(bn=128, bk=64, tm=256, warps_m=4, warps_n=1, stages=4, **WG),
                    "i8_t64x256k128wg2": dict(bn=256, bk=128, tm=64, warps_m=1, warps_n=2, stages=3, **WG),
                    "i8_b64_t64wg": dict(bn=64, bk=64, tm=64, warps_m=1, warps_n=1, stages=6, **WG),
                    "i8_b64_t128wgs3": dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=1, stages=3, **WG),
                    "i8_b32_t128wg": dict(bn=32, bk=32, tm=128, warps_m=2, warps_n=1, stages=6, **WG),
                    "i8_b64_t128wg": dict(bn=64, bk=64, tm=128, warps_m=2, warps_n=1, stages=6, **WG),
                    "i8_b64_t256wg": dict(bn=64, bk=64, tm=256, warps_m=4, warps_n=1, stages=6, **WG),
                    # 5 stages (3 blocks in flight; best FFN2), 2 CTAs per SM (96 KiB; best FFN1)
                    "i8_t128x192k128wgs5": dict(bn=192, bk=128, tm=128, warps_m=2, warps_n=1, stages=5, **WG),
                    "i8_t128x128k64wgs6": dict(bn=128, bk=64, tm=128, warps_m=2, warps_n=1, stages=6, **WG),
                    # a producer warpgroup (mbarrier rings); "pp": persistent, 132 CTAs (one per H100/H200 SM)
                    "i8_t128x192k128p": dict(bn=192, bk=128, tm=128, warps_m=2, warps_n=1, stages=4, **WGP),
                    "i8_t128x256k128p": dict(bn=256, bk=128, tm=128, warps_m=2, warps_n=2, stages=4, **WGP),
                    "i8_t128x256k128pp": dict(bn=256, bk=128, tm=128, warps_m=2, warps_n=2, stages=3, ctas=132,
                                              **WGP),
                    # ping-pong: two consumer warpgroups take alternate tiles from one ring (persistent, 132 CTAs)
                    **{f"i8_{t}pp2{sfx}": dict(kw, ctas=132, pingpong=True, **WGP) for t, sfx, kw in (
                        ("t128x128k64", "", dict(bn=128, bk=64, tm=128, warps_m=2, stages=8)),
                        ("t64x192k64", "", dict(bn=192, bk=64, tm=64, warps_m=1, stages=8)),
                        ("t128x128k64", "s10", dict(bn=128, bk=64, tm=128, warps_m=2, stages=10)),
                        ("t128x128k128", "", dict(bn=128, bk=128, tm=128, warps_m=2, stages=4)),
                        ("t128x128k128", "s5", dict(bn=128, bk=128, tm=128, warps_m=2, stages=5)),
                        # 192 accumulator registers per consumer thread: setmaxnreg moves registers from the producer
                        ("t128x192k128", "", dict(bn=192, bk=128, tm=128, warps_m=2, stages=4)),
                        ("t128x192k64", "", dict(bn=192, bk=64, tm=128, warps_m=2, stages=7)),
                        ("t64x192k128", "", dict(bn=192, bk=128, tm=64, warps_m=1, stages=4)),
                        ("b64_t128", "", dict(bn=64, bk=64, tm=128, warps_m=2, stages=8)),
                        ("b64_t64", "", dict(bn=64, bk=64, tm=64, warps_m=1, stages=8)))}}

# W4A16 GEMM (int4 weights dequantised in registers), by M: bench_cuda_w4_gemm.py
W4_TILES = {"t16x32k128": dict(tm=16, bn=32, bk=128, warps_m=1, warps_n=2, stages=4),
            "t64x128k128": dict(tm=64, bn=128, bk=128, warps_m=1, warps_n=4, stages=4),
            "t128x128k64": dict(tm=128, bn=128, bk=64, warps_m=2, warps_n=2, stages=4),
            "t128x128k64w8": dict(tm=128, bn=128, bk=64, warps_m=4, warps_n=2, stages=4)}
W4_GEMM_MS = {16: ("t16x32k128", "t64x128k128"), 64: ("t64x128k128",),
              **{m: ("t64x128k128", "t128x128k64", "t128x128k64w8") for m in (256, 1024, 4096)}}
W4_GEMM_SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}

CONST_TILES, CONST_SPARSITIES, CONST_SETS = ("b32_t128w2", "b64_t128", "b64_t128wg"), (90, 95), 4


def _pattern(mask: torch.Tensor) -> tuple:
    return tuple(map(tuple, torch.nonzero(mask).tolist()))


def kernels() -> dict[str, BsrSpec | QuantRowsSpec | LayerNormSpec | W8A8GemvSpec]:
    specs = {
        # correctness: odd M, partial last block row (N) and block column (K), every epilogue
        "t_odd_gelu": BsrSpec(200, 96, 72, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="gelu"),
        "t_gelu_erf": BsrSpec(130, 64, 96, bn=32, bk=32, tm=64, warps_m=2, stages=2, act="gelu_erf"),
        "t_ragged_relu": BsrSpec(130, 100, 40, bn=32, bk=32, tm=64, warps_m=2, stages=2, act="relu"),
        "t_const_nobias": BsrSpec(192, 128, 256, bn=32, bk=32, tm=64, warps_m=2, stages=3, bias=False,
                                  table="const", pattern=_pattern(bench_mask(4, 8, 0.4, "t_const"))),
        "t_b64": BsrSpec(257, 192, 320, bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3),
        "t_dense_tile": BsrSpec(256, 256, 128, **DENSE_TILES["t128x128k32"]),
        # streaming grid: odd M, ragged N and K, more groups than block rows (empty groups), const table
        "t_stream_gelu": BsrSpec(257, 192, 320, act="gelu", groups=2, **TUNED_TILES[64]),
        "t_stream_ragged_relu": BsrSpec(130, 100, 40, bn=32, bk=32, tm=64, warps_m=2, stages=2, act="relu",
                                        groups=5),
        "t_stream_const_nobias": BsrSpec(192, 128, 256, bn=32, bk=32, tm=64, warps_m=2, stages=3, bias=False,
                                         table="const", groups=3, pattern=_pattern(bench_mask(4, 8, 0.4, "t_const"))),
        "t_stream_odd_n": BsrSpec(77, 99, 64, bn=32, bk=32, tm=32, warps_m=2, stages=3, groups=2),
        "t_stream_i8_gelu": BsrSpec(257, 192, 320, bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3,
                                    act="gelu_erf", dtype="int8", groups=2),
        "t_stream_w4_zero": BsrSpec(200, 96, 200, bn=32, bk=64, tm=64, warps_m=2, stages=3, dtype="w4a16",
                                    zero=True, groups=2),
        # warps 1x2 on a 32x32 tile (16-column warp tiles), 16-blocks, 4x1 warps on 64-blocks
        "t_stream_wn2_relu": BsrSpec(150, 160, 96, bn=32, bk=32, tm=32, warps_m=1, warps_n=2, stages=2,
                                     act="relu", groups=3),
        "t_stream_b16": BsrSpec(70, 48, 64, bn=16, bk=16, tm=32, warps_m=2, warps_n=1, stages=2, groups=2),
        "t_stream_4x1_gelu": BsrSpec(200, 192, 128, bn=64, bk=64, tm=64, warps_m=4, stages=2, act="gelu", groups=3),
        # W8A8: odd M, ragged N, a half-filled last K block; 64-blocks with the exact GELU; no bias
        "t_i8_odd_relu": BsrSpec(200, 100, 80, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="relu", dtype="int8"),
        "t_i8_b64_gelu": BsrSpec(257, 192, 320, bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3,
                                 act="gelu_erf", dtype="int8"),
        "t_i8_dense_nobias": BsrSpec(256, 256, 256, bias=False, dtype="int8", **INT8_TILES["i8_t128x128k64"]),
        # wgmma (sm_90a): the same cases, every swizzle width (rows of 32, 64, 128 bytes), 1-4 warpgroups
        "t_wg_odd_gelu": BsrSpec(200, 96, 72, bn=32, bk=32, tm=128, warps_m=2, stages=3, act="gelu", **WG),
        "t_wg_ragged_relu": BsrSpec(130, 100, 40, bn=32, bk=32, tm=64, warps_m=1, stages=4, act="relu", **WG),
        "t_wg_k16_gelu_erf": BsrSpec(130, 64, 96, bn=64, bk=16, tm=64, warps_m=1, stages=3, act="gelu_erf", **WG),
        "t_wg_const_nobias": BsrSpec(192, 128, 256, bn=32, bk=32, tm=64, warps_m=1, stages=4, bias=False,
                                     table="const", pattern=_pattern(bench_mask(4, 8, 0.4, "t_const")), **WG),
        "t_wg_b64": BsrSpec(257, 192, 320, bn=64, bk=64, tm=128, warps_m=2, stages=4, **WG),
        "t_wg_dense_2x2": BsrSpec(256, 512, 192, bn=256, bk=64, tm=128, warps_m=2, warps_n=2, stages=3, **WG),
        "t_wg_dense_256": BsrSpec(300, 256, 128, bn=128, bk=64, tm=256, warps_m=4, stages=4, **WG),
        "t_wg_i8_odd_relu": BsrSpec(200, 100, 80, bn=32, bk=32, tm=64, warps_m=1, stages=3, act="relu",
                                    dtype="int8", **WG),
        "t_wg_i8_b64_gelu": BsrSpec(257, 192, 320, bn=64, bk=64, tm=128, warps_m=2, stages=4, act="gelu_erf",
                                    dtype="int8", **WG),
        "t_wg_i8_dense_nobias": BsrSpec(256, 256, 256, bias=False, dtype="int8",
                                        **INT8_WGMMA_TILES["i8_t128x256k128wg"]),
        # warp-specialised wgmma (a producer warpgroup; ctas > 0: persistent, several tiles per CTA)
        "t_ws_odd_gelu": BsrSpec(200, 96, 72, bn=32, bk=32, tm=128, warps_m=2, stages=3, act="gelu", **WGP),
        "t_ws_dense_2x2": BsrSpec(256, 512, 192, bn=256, bk=64, tm=128, warps_m=2, warps_n=2, stages=3, **WGP),
        "t_ws_const_nobias": BsrSpec(192, 128, 256, bn=32, bk=32, tm=64, warps_m=1, stages=4, bias=False, ctas=4,
                                     table="const", pattern=_pattern(bench_mask(4, 8, 0.4, "t_const")), **WGP),
        "t_ws_i8_ragged_relu": BsrSpec(300, 100, 320, bn=32, bk=64, tm=64, warps_m=1, stages=3, act="relu",
                                       dtype="int8", ctas=3, **WGP),
        "t_ws_i8_b64_gelu_q8": BsrSpec(257, 192, 320, bn=64, bk=128, tm=128, warps_m=2, stages=4, act="gelu_erf",
                                       dtype="int8", out="int8", ctas=2, **WGP),
        # ping-pong (two consumer warpgroups take alternate tiles): both row halves from one warpgroup, one;
        # a few CTAs, so each role runs several tiles and the ring wraps
        "t_pp_i8_relu_q8": BsrSpec(300, 200, 320, bn=64, bk=64, tm=128, warps_m=2, stages=6, act="relu",
                                   dtype="int8", out="int8", ctas=3, pingpong=True, **WGP),
        "t_pp_odd_gelu": BsrSpec(200, 96, 72, bn=32, bk=32, tm=64, warps_m=1, stages=6, act="gelu", ctas=2,
                                 pingpong=True, **WGP),
        "t_pp_i8_dense_gelu_q8": BsrSpec(256, 384, 256, bn=128, bk=64, tm=128, warps_m=2, stages=8, act="gelu_erf",
                                         dtype="int8", out="int8", ctas=2, pingpong=True, **WGP),
        "t_pp_i8_192_relu_q8": BsrSpec(300, 384, 256, bn=192, bk=64, tm=128, warps_m=2, stages=4, act="relu",
                                       dtype="int8", out="int8", ctas=2, pingpong=True, **WGP),
        "t_pp_i8_k128_nobias": BsrSpec(130, 192, 384, bn=64, bk=128, tm=64, warps_m=1, stages=6, bias=False,
                                       dtype="int8", ctas=3, pingpong=True, **WGP),
        # the dense W8A8 pair compile() builds (mma.sync fallback + wgmma, same 192x128 blocks)
        "t_i8_dense_192": BsrSpec(300, 384, 256, act="gelu_erf", dtype="int8", **int8_dense_tiles(300, 384)[0]),
        "t_wg_i8_dense_192": BsrSpec(300, 384, 256, act="gelu_erf", dtype="int8", **int8_dense_tiles(300, 384)[1]),
        # out="int8": requantised to the codes of one static scale; vectorised (N % 16 == 0) and ragged stores
        "t_i8_b64_gelu_q8": BsrSpec(257, 192, 320, bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3,
                                    act="gelu_erf", dtype="int8", out="int8"),
        # programmatic dependent launch: square (a launch's output is the next one's input), fp16 and W8A8 codes
        "t_pdl_square_gelu": BsrSpec(200, 192, 192, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="gelu", pdl="tail"),
        "t_pdl_i8_b64_square_relu_q8": BsrSpec(257, 192, 192, bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3,
                                               act="relu", dtype="int8", out="int8", pdl="late"),
        "t_i8_odd_relu_q8": BsrSpec(200, 100, 80, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="relu", dtype="int8",
                                    out="int8"),
        "t_wg_i8_dense_192_q8": BsrSpec(300, 384, 256, act="gelu_erf", dtype="int8", out="int8",
                                        **int8_dense_tiles(300, 384)[1]),
        "t_stream_i8_gelu_q8": BsrSpec(257, 192, 320, bn=64, bk=64, tm=128, warps_m=2, warps_n=2, stages=3,
                                       act="gelu_erf", dtype="int8", groups=2, out="int8"),
        "t_odd_gelu_q8": BsrSpec(200, 96, 72, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="gelu", out="int8"),
        # no activation or ReLU: RN(1/s) folded into the staged column constants, in every kernel kind
        "t_odd_q8": BsrSpec(200, 96, 72, bn=32, bk=32, tm=64, warps_m=2, stages=3, out="int8"),
        "t_wg_i8_dense_192_relu_q8": BsrSpec(300, 384, 256, act="relu", dtype="int8", out="int8",
                                             **int8_dense_tiles(300, 384)[1]),
        "t_stream_i8_q8": BsrSpec(257, 192, 320, bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=2, dtype="int8",
                                  groups=3, out="int8"),
        "t_ws_i8_relu_q8": BsrSpec(300, 100, 320, bn=32, bk=64, tm=64, warps_m=1, stages=3, act="relu", dtype="int8",
                                   out="int8", ctas=3, **WGP),
        # W4A16 (int4 records, lop3 dequantisation): odd M, ragged N/K, zero points, const table, M of 16
        "t_w4_odd_gelu": BsrSpec(200, 96, 200, bn=32, bk=32, tm=64, warps_m=2, stages=3, act="gelu", dtype="w4a16"),
        "t_w4_ragged_zero_relu": BsrSpec(130, 100, 200, bn=32, bk=64, tm=64, warps_m=2, stages=2, act="relu",
                                         dtype="w4a16", zero=True),
        "t_w4_b64": BsrSpec(257, 192, 320, dtype="w4a16", **TUNED_TILES[64]),
        "t_w4_dense_zero_gelu_erf": BsrSpec(300, 256, 512, act="gelu_erf", dtype="w4a16", zero=True,
                                            **W4_TILES["t128x128k64w8"]),
        "t_w4_k128_nobias": BsrSpec(77, 256, 640, bias=False, dtype="w4a16", **W4_TILES["t64x128k128"]),
        "t_w4_m16": BsrSpec(16, 96, 384, dtype="w4a16", **W4_TILES["t16x32k128"]),
        "t_w4_const": BsrSpec(192, 128, 256, bn=32, bk=32, tm=64, warps_m=2, stages=3, dtype="w4a16",
                              table="const", pattern=_pattern(bench_mask(4, 8, 0.4, "t_const"))),
    }
    for shape_name, (m, n, k) in (("ffn1", FFN1), ("ffn2", FFN2)):
        for tile, kw in {**DENSE_TILES, **SPARSE_TILES, **WGMMA_TILES}.items():
            specs[f"{shape_name}_{tile}"] = BsrSpec(m, n, k, bias=True, **kw)
        for tile, kw in {**INT8_TILES, **INT8_WGMMA_TILES}.items():
            if tile not in INT8_Q8_ONLY:
                specs[f"{shape_name}_{tile}"] = BsrSpec(m, n, k, bias=True, dtype="int8", **kw)
            if tile in INT8_Q8_TILES or tile in INT8_Q8_ONLY:
                specs[f"{shape_name}_{tile}_q8"] = BsrSpec(m, n, k, bias=True, dtype="int8", out="int8", **kw)
            for pdl in ("late", "tail") if tile in INT8_PDL_TILES else ():
                sfx = "_pdl" if pdl == "late" else "_pdlt"
                specs[f"{shape_name}_{tile}{sfx}"] = BsrSpec(m, n, k, bias=True, dtype="int8", pdl=pdl, **kw)
                specs[f"{shape_name}_{tile}{sfx}_q8"] = BsrSpec(m, n, k, bias=True, dtype="int8", out="int8", pdl=pdl,
                                                                **kw)
        for tile in CONST_TILES:                 # dismantled: the benchmark's block patterns baked in
            kw = {**SPARSE_TILES, **WGMMA_TILES}[tile]
            for sp in CONST_SPARSITIES:
                for i in range(CONST_SETS):
                    mask = bench_mask(-(-n // kw["bn"]), -(-k // kw["bk"]), 1 - sp / 100,
                                      f"{shape_name}-{kw['bn']}-{sp}-{i}")
                    specs[f"{shape_name}_{tile}c_sp{sp}_s{i}"] = BsrSpec(m, n, k, bias=True, table="const",
                                                                        pattern=_pattern(mask), **kw)
        for tile in ("b32_t128w2", "b64_t128"):      # block-sparse W4A16, compile()'s tiles
            specs[f"{shape_name}_w4_{tile}"] = BsrSpec(m, n, k, bias=True, dtype="w4a16", **SPARSE_TILES[tile])
    for shape, (n, k) in W4_GEMM_SHAPES.items():   # dense W4A16 GEMM (bench_cuda_w4_gemm.py)
        for m, tiles in W4_GEMM_MS.items():
            for tile in tiles:
                specs[f"w4g_{shape}_m{m}_{tile}"] = BsrSpec(m, n, k, bias=False, dtype="w4a16", **W4_TILES[tile])
    specs["t_q_odd"] = QuantRowsSpec(37, 200, threads=32)              # W8A8 activation quantiser: warp per row
    specs["t_q_cta"] = QuantRowsSpec(45, 1000, threads=128)            # CTA per row, ragged last chunk
    specs["t_q_wide"] = QuantRowsSpec(6, 4104, threads=32)             # 17 chunks per lane, M not a multiple of 4
    # W8A8 GEMV (dp4a, per-channel weights, per-token activations): N not a multiple of the warps, K not of the
    # 512 bytes a warp loads, batches shorter than the group, every M up to 16, the epilogues, pdl
    specs["t_w8g_odd_relu"] = W8A8GemvSpec(3, 101, 1040, group=2, bias=True, act="relu")
    specs["t_w8g_m1"] = W8A8GemvSpec(1, 256, 4096)
    specs["t_w8g_m16_gelu_late"] = W8A8GemvSpec(16, 200, 2064, warps=8, bias=True, act="gelu_erf", pdl="late")
    specs["t_w8g_m8_early"] = W8A8GemvSpec(8, 64, 11008, warps=2, group=3, pdl="early")
    specs["t_w8g_mma_odd_relu"] = W8A8GemvSpec(3, 101, 1056, group=2, bias=True, act="relu", mma=True)
    specs["t_w8g_mma_m16_gelu_late"] = W8A8GemvSpec(16, 200, 2080, warps=8, bias=True, act="gelu_erf", pdl="late",
                                                    mma=True)
    specs["t_w8g_mma_m1_early"] = W8A8GemvSpec(1, 64, 11008, warps=16, group=3, pdl="early", mma=True)
    specs["t_w8g_mma_m9"] = W8A8GemvSpec(9, 48, 4096, warps=2, group=8, mma=True)
    specs["t_w8g_q8_relu"] = W8A8GemvSpec(3, 101, 1040, group=2, bias=True, act="relu", out="int8")
    specs["t_w8g_sparse_odd_relu"] = W8A8GemvSpec(3, 101, 1056, warps=4, group=2, bias=True, act="relu", mma=True,
                                                  sparse=True)
    specs["t_w8g_sparse_m16_q8_late"] = W8A8GemvSpec(16, 200, 2080, warps=2, group=3, bias=True, act="gelu_erf",
                                                     mma=True, sparse=True, out="int8", pdl="late")
    specs["t_w8g_mma_q8_gelu_late"] = W8A8GemvSpec(9, 200, 2080, warps=8, bias=True, act="gelu_erf", pdl="late",
                                                   mma=True, out="int8")
    specs.update(w8a8_gemv_bench_kernels())
    specs["q_ffn1"] = QuantRowsSpec(*FFN1[::2])
    specs["q_ffn2"] = QuantRowsSpec(*FFN2[::2])
    # LayerNorm (+ per-token int8): odd rows, ragged chunks per thread, a CTA per row, no affine
    specs["t_ln_warp_both"] = LayerNormSpec(37, 1000, out="both")
    specs["t_ln_plain"] = LayerNormSpec(5, 24, affine=False, bias=False)
    specs["t_ln_cta_int8"] = LayerNormSpec(33, 4104, out="int8", threads=pick_threads(4104))
    specs["t_ln_cta2_weight_only"] = LayerNormSpec(16, 768, bias=False, out="both", threads=64)
    specs["t_ln_res_warp_both"] = LayerNormSpec(37, 1000, out="both", residual=True)
    specs["t_ln_res_cta_fp16"] = LayerNormSpec(33, 4104, residual=True, threads=pick_threads(4104))
    for m, n in LN_SHAPES:                         # bench_cuda_layernorm.py
        for out in ("fp16", "int8", "both"):
            specs[f"ln_{m}x{n}_{out}"] = LayerNormSpec(m, n, out=out, threads=pick_threads(n))
        specs[f"ln_{m}x{n}_fp16_res"] = LayerNormSpec(m, n, residual=True, threads=pick_threads(n))
        specs[f"q_ln_{m}x{n}"] = QuantRowsSpec(m, n)
    return {name: type(s)(**{**asdict(s), "name": name}) for name, s in specs.items()}


W8G_SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}
W8G_BATCHES = (1, 4, 8, 16)
W8G_SPARSE_TILINGS = {f"sparse_w{w}g{g}": dict(warps=w, group=g, mma=True, sparse=True) for w, g in
                      ((2, 2), (4, 2), (4, 4), (8, 2), (16, 1))}
W8G_TILINGS = {"w4g8": dict(warps=4, group=8), "w8g8": dict(warps=8, group=8), "w4g4": dict(warps=4, group=4),
               "w2g8": dict(warps=2, group=8), "w4g8_pdle": dict(warps=4, group=8, pdl="early"),
               "w4g8_pdl": dict(warps=4, group=8, pdl="late"),
               **{f"mma_w{w}g{g}{sfx}": dict(warps=w, group=g, mma=True, pdl=pdl) for w, g, sfx, pdl in (
                   (4, 4, "", ""), (8, 4, "", ""), (8, 8, "", ""), (16, 4, "", ""), (16, 8, "", ""),
                   (8, 8, "_pdle", "early"), (16, 4, "_pdle", "early"))}}


def w8a8_gemv_bench_kernels() -> dict:
    """``bench_cuda_w8a8_gemv.py``'s kernels: the GEMV's tilings per shape and batch, and the tile kernels (mma.sync
    and wgmma) that compile built for these ops before the GEMV."""
    specs = {}
    for shape, (n, k) in W8G_SHAPES.items():
        for m in W8G_BATCHES:
            for tiling, kw in W8G_TILINGS.items():
                specs[f"w8g_{shape}_m{m}_{tiling}"] = W8A8GemvSpec(m, n, k, **kw)
            specs[f"w8q_{m}x{k}"] = QuantRowsSpec(m, k, threads=pick_quant_threads(k))
            if m in (1, 16):
                sync, hopper = int8_dense_tiles(m, n)
                specs[f"w8t_{shape}_m{m}_sync"] = BsrSpec(m, n, k, bias=False, dtype="int8", **sync)
                specs[f"w8t_{shape}_m{m}_wgmma"] = BsrSpec(m, n, k, bias=False, dtype="int8", **hopper)
                # 90% of 32x32 blocks pruned (--sparsity): the sparse GEMV and the W8A8 block tile compile used before
                for tiling, kw in W8G_SPARSE_TILINGS.items():
                    specs[f"w8s_{shape}_m{m}_{tiling}"] = W8A8GemvSpec(m, n, k, **kw)
                specs[f"w8b_{shape}_m{m}_tile"] = BsrSpec(m, n, k, bias=False, dtype="int8", **INT8_TILES["i8_b32_t128"])
    return specs


def saved_models(out: Path) -> None:
    """Small models compiled for CUDA and saved, for ``tests/runtime/test_saved_cuda.py``: an fp32
    MLP on 3×333 tokens (odd M) with a 32- and a 64-block sparse linear (1.4 blocks per block row: the
    streaming grid), ReLU fused; the same
    MLP calibrated to W8A8 (activations per token; and with a static scale between the linears); and, in fp16 on 16 tokens, calibrated to 4-bit weights (W4A16)."""
    import sparta
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
                                torch.nn.GELU()).eval()
    masks = {"0.weight": bench_mask(64, 32, 0.15, "saved-mlp-0").repeat_interleave(32, 0).repeat_interleave(32, 1),
             "2.weight": bench_mask(16, 32, 0.03, "saved-mlp-2").repeat_interleave(64, 0).repeat_interleave(64, 1)}
    compiled = sparta.compile(model, masks, (torch.randn(3, 333, 1024),), target="cuda")
    print(compiled.kernel_report())
    compiled.save(out / "saved_mlp")
    # the same model calibrated to W8A8 (int8 kernels + the per-token quantiser), first linear 85% sparse
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(3, 333, 1024, generator=g),) for _ in range(2)]
    per_token = {"tolerance": 1e-2, "activations": True, "static_activations": False, "progress": False}
    w8 = sparta.compile(model, {"0.weight": masks["0.weight"]}, batches[0], target="cuda", calibration=batches,
                        quant_tolerance=per_token)
    print(w8.kernel_report())
    w8.save(out / "saved_mlp_w8a8")
    # and with the ReLU output at a static scale: the first linear writes the second's int8 codes
    w8s = sparta.compile(model, {"0.weight": masks["0.weight"]}, batches[0], target="cuda", calibration=batches,
                         quant_tolerance={**per_token, "static_activations": True})
    print(w8s.kernel_report())
    w8s.save(out / "saved_mlp_w8a8_static")
    # an fp16 MLP on 16 tokens (decode-like) with 4-bit weights (groups of 128, asymmetric): W4A16 kernels
    half = [(torch.randn(2, 8, 1024, generator=g).half(),) for _ in range(2)]
    w4 = sparta.compile(model.half(), {"0.weight": masks["0.weight"]}, half[0], target="cuda", calibration=half,
                        quant_tolerance={"tolerance": 5e-2, "widths": (4,), "symmetric": False, "progress": False})
    print(w4.kernel_report())
    w4.save(out / "saved_mlp_w4a16")
    saved_decode_w4a16(out)
    saved_decode_w8a8(out)
    # post-LN block (LayerNorm -> W8A8 MLP + residual, 3x333 tokens): the norm kernel emits fp16 and int8
    block = _NormBlock().eval()
    with torch.no_grad():
        block.ln.weight.uniform_(0.5, 1.5, generator=g)
        block.ln.bias.uniform_(-0.5, 0.5, generator=g)
    batches = [(torch.randn(3, 333, 1024, generator=g) * 3 + 1,) for _ in range(2)]
    ln8 = sparta.compile(block, {"fc1.weight": masks["0.weight"]}, batches[0], target="cuda", calibration=batches,
                         quant_tolerance=per_token)
    print(ln8.kernel_report())
    ln8.save(out / "saved_norm_w8a8")
    # fp16 post-LN sublayer (BERT width, 4x96 tokens): the residual add fused into sparta's LayerNorm
    post = _PostLNBlock().half().eval()
    fp16 = sparta.compile(post, {"fc.weight": masks["0.weight"][:768, :768]}, (torch.randn(4, 96, 768).half(),),
                          target="cuda")
    print(fp16.kernel_report())
    fp16.save(out / "saved_postln_fp16")
    saved_pingpong_ffn(out)


def saved_decode_w4a16(out: Path) -> None:
    """Two dense fp16 linears back to back on 4 tokens (decode-like) calibrated to 4-bit weights (groups of 128, zero
    points), for ``tests/runtime/test_saved_cuda.py``: both run the W4A16 GEMV with programmatic dependent launch, the
    second's launch overlapping the first's tail."""
    import sparta
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024), torch.nn.ReLU()).half().eval()
    g = torch.Generator().manual_seed(5)
    half = [(torch.randn(1, 4, 1024, generator=g).half(),) for _ in range(2)]
    w4 = sparta.compile(model, {}, half[0], target="cuda", calibration=half,
                        quant_tolerance={"tolerance": 5e-2, "widths": (4,), "symmetric": False, "progress": False})
    print(w4.kernel_report())
    w4.save(out / "saved_decode_w4a16")


def saved_decode_w8a8(out: Path) -> None:
    """LayerNorm → linear → GELU → linear on 4 tokens (decode-like), fp16, calibrated to W8A8 with a static scale
    after the GELU, the first linear 70% block-sparse, for ``tests/runtime/test_saved_cuda.py``: both run the W8A8
    GEMV (the first its sparse kernel) — the first on the int8 codes the LayerNorm kernel emits, writing the codes of
    GELU(·) at the static scale that the second reads."""
    import sparta
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 1024)).half().eval()
    g = torch.Generator().manual_seed(7)
    half = [(torch.randn(1, 4, 1024, generator=g).half(),) for _ in range(2)]
    mask = bench_mask(64, 32, 0.3, "saved-decode-w8a8").repeat_interleave(32, 0).repeat_interleave(32, 1)
    w8 = sparta.compile(model, {"1.weight": mask}, half[0], target="cuda", calibration=half,
                        quant_tolerance={"tolerance": 5e-2, "activations": True, "progress": False})
    print(w8.kernel_report())
    w8.save(out / "saved_decode_w8a8")


def saved_pingpong_ffn(out: Path) -> None:
    """A dense BERT-base FFN (768 → 3072 → GELU → 768) on 4096 tokens calibrated to W8A8 with GELU(FFN1) at a static
    scale, for ``tests/runtime/test_saved_cuda.py``: FFN1 writes FFN2's int8 codes, on Hopper from the ping-pong
    kernel (``codegen.specialize_cuda.int8_codes_spec``)."""
    import sparta
    torch.manual_seed(2)
    ffn = torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768)).eval()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 512, 768, generator=g),) for _ in range(2)]
    pp = sparta.compile(ffn, {}, batches[0], target="cuda", calibration=batches,
                        quant_tolerance={"tolerance": 1e-2, "activations": True, "progress": False})
    print(pp.kernel_report())
    pp.save(out / "saved_ffn_w8a8_pingpong")


class _NormBlock(torch.nn.Module):
    """``ln(x) + fc2(relu(fc1(ln(x))))``: a LayerNorm read by a linear and a residual (as ``tests/models.NormBlock``)."""

    def __init__(self, d=1024, hidden=2048):
        super().__init__()
        self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def forward(self, x):
        h = self.ln(x)
        return self.fc2(torch.relu(self.fc1(h))) + h


class _PostLNBlock(torch.nn.Module):
    """``ln2(ln(x + fc(x)))``: a residual add read only by a LayerNorm (as ``tests/models.PostLNBlock``)."""

    def __init__(self, d=768):
        super().__init__()
        self.fc, self.ln, self.ln2 = torch.nn.Linear(d, d), torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        with torch.no_grad():
            for ln in (self.ln, self.ln2):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.ln2(self.ln(self.fc(x) + x))


TEMPLATES = {BsrSpec: bsr_linear, QuantRowsSpec: quantize_rows_kernel, LayerNormSpec: layer_norm_kernel,
             W8A8GemvSpec: w8a8_gemv}


def build_all(specs: dict, out: Path, jobs: int, templates=TEMPLATES) -> None:
    """Build every spec (through the template its type names) into ``out/<name>/``, ``jobs`` at a time."""
    out.mkdir(parents=True, exist_ok=True)

    def one(item):
        name, spec = item
        t0 = time.perf_counter()
        art = build_cuda(templates[type(spec)], spec)
        dest = out / name
        shutil.rmtree(dest, ignore_errors=True)
        save_dir(art, dest)
        return name, art, time.perf_counter() - t0

    with ThreadPoolExecutor(jobs) as pool:
        for name, art, dt in pool.map(one, specs.items()):
            print(f"{name}: grid {art.launch['grid']} block {art.launch['block']} smem {art.launch['shared_bytes']} "
                  f"({'cached' if art.cached else f'built in {dt:.1f} s'})", flush=True)


def arguments(default_out: Path) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--only", nargs="*", help="names to build (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    return ap.parse_args()


def main():
    args = arguments(Path(__file__).resolve().parents[1] / "artifacts" / "cuda")
    out = Path(args.out)
    if not args.only:
        out.mkdir(parents=True, exist_ok=True)
        saved_models(out)
    build_all({n: s for n, s in kernels().items() if not args.only or n in args.only}, out, args.jobs)


if __name__ == "__main__":
    main()
