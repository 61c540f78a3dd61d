"""Build the CUDA kernels the GPU benchmarks time, here (TVM + nvcc, no GPU needed), for the GPU machine (no TVM).

    python benchmarks/build_cuda_kernels.py [--only NAME ...]     # writes artifacts/cuda/<name>/

Each folder holds the CUDA source, cubins for sm_80 and sm_90 (sm_90a for wgmma), launch.json and spec.json;
``benchmarks/bench_cuda_*.py`` load them on the GPU machine through ``sparta.runtime.cuda`` (cuda-bindings). The
GPU tests' kernels and saved models are built by ``tests/fixtures/build_cuda.py``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_cuda_layernorm import LN_SHAPES  # noqa: E402
from common import bench_mask  # noqa: E402

from sparta.codegen.cuda_build import build_folders  # noqa: E402
from sparta.templates.bsr_linear.select import int8_dense_tiles  # noqa: E402
from sparta.target import load_target  # noqa: E402
from sparta.templates.bsr_linear.spec import BsrSpec  # noqa: E402
from sparta.templates.norm.spec import LayerNormSpec, pick_threads  # noqa: E402
from sparta.templates.quant.spec import QuantRowsSpec  # noqa: E402
from sparta.templates.quant.spec import pick_threads as pick_quant_threads  # noqa: E402
from sparta.templates.w8a8_gemv.spec import W8A8GemvSpec  # noqa: E402

CUDA = load_target("cuda")                # the measured tile tables compile picks from

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
                "b32_t128w2": CUDA.tiles("fp16_tiles", 32),
                "b64_t128": CUDA.tiles("fp16_tiles", 64),
                "b64_t256": dict(bn=64, bk=64, tm=256, warps_m=4, warps_n=1, stages=3),
                "b64_t64": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=3),
                "b64_t64s2": dict(bn=64, bk=64, tm=64, warps_m=2, warps_n=2, stages=2),
                # streaming grid (templates/bsr_linear/stream.py): CTA (m tile, group) runs the group's rows
                "b64_t128g12": dict(CUDA.tiles("fp16_tiles", 64), groups=12),
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
            "t64x128k128gw": dict(tm=64, bn=128, bk=128, warps_m=1, warps_n=4, stages=4, gemv_group=128),
            "t128x128k64": dict(tm=128, bn=128, bk=64, warps_m=2, warps_n=2, stages=4),
            "t128x128k64w8": dict(tm=128, bn=128, bk=64, warps_m=4, warps_n=2, stages=4)}
W4_GEMM_MS = {16: ("t16x32k128", "t64x128k128", "t64x128k128gw"), 64: ("t64x128k128", "t64x128k128gw"),
              **{m: ("t64x128k128", "t64x128k128gw", "t128x128k64", "t128x128k64w8") for m in (256, 1024, 4096)}}
W4_GEMM_SHAPES = {"4096x4096": (4096, 4096), "11008x4096": (11008, 4096), "4096x11008": (4096, 11008)}

CONST_TILES, CONST_SPARSITIES, CONST_SETS = ("b32_t128w2", "b64_t128", "b64_t128wg"), (90, 95), 4


def _pattern(mask: torch.Tensor) -> tuple:
    return tuple(map(tuple, torch.nonzero(mask).tolist()))


def kernels() -> dict[str, BsrSpec | QuantRowsSpec | LayerNormSpec | W8A8GemvSpec]:
    """Kernel name (its folder under ``artifacts/cuda/``) -> spec, for the benchmark scripts."""
    specs = {}
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
    specs.update(w8a8_gemv_bench_kernels())
    specs["q_ffn1"] = QuantRowsSpec(*FFN1[::2])
    specs["q_ffn2"] = QuantRowsSpec(*FFN2[::2])
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
                sync, hopper = int8_dense_tiles(m, n, CUDA)
                specs[f"w8t_{shape}_m{m}_sync"] = BsrSpec(m, n, k, bias=False, dtype="int8", **sync)
                specs[f"w8t_{shape}_m{m}_wgmma"] = BsrSpec(m, n, k, bias=False, dtype="int8", **hopper)
                # 90% of 32x32 blocks pruned (--sparsity): the sparse GEMV and the W8A8 block tile compile used before
                for tiling, kw in W8G_SPARSE_TILINGS.items():
                    specs[f"w8s_{shape}_m{m}_{tiling}"] = W8A8GemvSpec(m, n, k, **kw)
                specs[f"w8b_{shape}_m{m}_tile"] = BsrSpec(m, n, k, bias=False, dtype="int8", **INT8_TILES["i8_b32_t128"])
    return specs


def arguments(default_out: Path) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--only", nargs="*", help="names to build (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    return ap.parse_args()


def main():
    args = arguments(Path(__file__).resolve().parents[1] / "artifacts" / "cuda")
    build_folders({n: s for n, s in kernels().items() if not args.only or n in args.only}, Path(args.out), args.jobs,
                  log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
