"""The MoE models' CPU kernels side by side in one run (best of alternating repeats; the machine is
shared, so read the ratios):

the grouped expert kernel with a dynamic vs a static thread schedule, with its weights packed in
   huge-page-advised memory vs plain (kernels/huge_pages.py), with the last row tile prefetching the
   next block vs not (all the same bits), at the V3 layer's shapes (32 experts of 1024 x 256, top-4), and against the same kernel on one expert's weights
   over all T * top-k rows (dense, same K / N, same threads); and the roofline of the grouped GEMM
   from the read bandwidth measured in the same run (common.read_bandwidth_gbs): the dense GEMM reuses
   each weight T * top-k times from cache, the grouped one only its expert's rows' worth from memory,
   so it can reach at most min(dense, 2 * rows / bytes-per-weight * bandwidth), the active experts'
   weights read once. (At a few tokens the active experts' weights are not much more than the L3, and
   the repeated calls find part of them there: the roofline understates what is possible, and
   grouped/roofline can pass 1.)

    python benchmarks/moe_kernels.py [--tokens 32 128 512] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import read_bandwidth_gbs
from deepinfer_kernels import moe_gemm


def best_of(fns, repeats):
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    print(f"threads={torch.get_num_threads()} best of {args.repeats} (shared, loaded machine: compare the ratios)")
    g = torch.Generator().manual_seed(0)
    E, H, I, k = 32, 1024, 256, 4
    gu, down = torch.randn(E, 2 * I, H, generator=g) * 0.03, torch.randn(E, H, I, generator=g) * 0.03
    experts = moe_gemm.pack_experts(gu, down)
    plain = moe_gemm.pack_experts(gu, down, huge=False)
    one = moe_gemm.pack_experts(gu[:1].contiguous(), down[:1].contiguous())
    print("\ngrouped experts (32 x 1024 x 256, top-4), GFLOP/s: the default (dynamic schedule, huge-page packing,")
    print("last tile prefetching the next block) against each switched off; grouped vs dense (one expert, same kernel)")
    bw = read_bandwidth_gbs(256 << 20)
    print(f"read bandwidth {bw:.1f} GB/s; roofline = min(dense, FLOPs / (active experts' weight bytes / bandwidth))")
    print(f"{'tokens':>6} {'default':>8} {'static':>8} {'x':>6} {'plain pg':>9} {'x':>6} {'no pf-next':>11} {'x':>6} "
          f"{'dense':>7} {'grouped/dense':>14} {'roofline':>9} {'/dense':>7} {'grouped/roofline':>17}")

    def run(x, idx, packed, dynamic=True, pf_next=True):
        moe_gemm.set_dynamic_schedule(dynamic)
        moe_gemm.set_prefetch_next(pf_next)
        moe_gemm.moe_experts(x, idx, packed)

    with torch.inference_mode():
        for T in args.tokens:
            x = torch.randn(T, H, generator=g)
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            xr = torch.randn(T * k, H, generator=g)
            zeros = torch.zeros(T * k, 1, dtype=torch.long)
            flops = 2.0 * T * k * 3 * H * I
            try:
                t = best_of([lambda: run(x, idx, experts), lambda: run(x, idx, experts, dynamic=False),
                             lambda: run(x, idx, plain), lambda: run(x, idx, experts, pf_next=False),
                             lambda: run(xr, zeros, one)], args.repeats)
            finally:
                moe_gemm.set_dynamic_schedule(True)
                moe_gemm.set_prefetch_next(True)
            r = [flops / s / 1e9 for s in t]
            weight_bytes = idx.unique().numel() * 3 * H * I * 4
            roof = min(r[4], flops / (weight_bytes / (bw * 1e9)) / 1e9)
            print(f"{T:>6} {r[0]:>8.1f} {r[1]:>8.1f} {r[0] / r[1]:>5.2f}x {r[2]:>9.1f} {r[0] / r[2]:>5.2f}x "
                  f"{r[3]:>11.1f} {r[0] / r[3]:>5.2f}x {r[4]:>7.1f} {r[0] / r[4]:>14.2f} {roof:>9.1f} {roof / r[4]:>7.2f} "
                  f"{r[0] / roof:>17.2f}", flush=True)


if __name__ == "__main__":
    main()
