"""How fast can a kernel write BERT FFN1's int8 output (4096 x 3072) in tiles? (GPU machine; cupy.)

    python benchmarks/probes/write_probe.py

Each CTA writes TM x BN int8 tiles with 16-byte stores, the tile order m-fast (blockIdx.x = m tile, as
``bsr_linear``'s grid) or n-fast; ``torch.fill_`` of the same bytes is the reference. Rotating outputs, CUDA graphs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # benchmarks/
from common import gpu_kernel_us, save  # noqa: E402

SRC = r"""
extern "C" __global__ void wtile(signed char* Y, int M, int N, int TM, int BN, int mfast, int persist) {
  int tiles_m = M / TM, tiles_n = N / BN, per_row = BN / 16, chunks = TM * per_row;
  int ntiles = tiles_m * tiles_n;
  for (int t = blockIdx.x; t < ntiles; t += (persist ? gridDim.x : ntiles)) {
    int tm = mfast ? t % tiles_m : t / tiles_n, tn = mfast ? t / tiles_m : t % tiles_n;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      int r = c / per_row, cc = c % per_row;
      int4 v = make_int4(r, cc, t, c);
      *(int4*)(Y + (size_t)(tm * TM + r) * N + tn * BN + cc * 16) = v;
    }
  }
}
"""


def main():
    m, n, sets = 4096, 3072, 8
    ys = [torch.empty(m, n, dtype=torch.int8, device="cuda") for _ in range(sets)]
    kern = cupy.RawKernel(SRC, "wtile")
    rows = {"fill_": gpu_kernel_us(lambda i: ys[i].fill_(3), sets)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launcher(tm, bn, mfast, threads, persist):
        grid = sms * persist if persist else (m // tm) * (n // bn)     # persist: CTAs per SM, looping over tiles

        def fn(i):
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            with stream:
                kern((grid,), (threads,), (ys[i].data_ptr(), cupy.int32(m), cupy.int32(n), cupy.int32(tm),
                                           cupy.int32(bn), cupy.int32(mfast), cupy.int32(persist)))
        return fn

    for tm in (64, 128):
        for bn in (64, 128, 256):
            for mfast in (1, 0):
                for persist in (0, 4, 8):
                    key = f"t{tm}x{bn}_{'mfast' if mfast else 'nfast'}_p{persist}"
                    rows[key] = gpu_kernel_us(launcher(tm, bn, mfast, 128, persist), sets)
    for k, v in rows.items():
        print(f"{k:28s} {v:7.2f} us  {m * n / v / 1e3:7.0f} GB/s")
    print(f"wrote {save('write_probe', {'device': torch.cuda.get_device_name(), 'us': rows})}")


if __name__ == "__main__":
    main()
