"""The quantised-weight kernels per projection, side by side in one process: the row kernel (exact and
int8), the exact panel kernel (row-kernel order: the batch-invariant mode's many-row path), the
outer-product kernel (the default mode's many-row path), dequantise-then-oneDNN (the path without
AVX2) and the fp32 engine's own GEMM on the same weights (CpuLinear, oneDNN prepacked on AVX2). SmolLM2-135M's shapes; the k-quants
only where K is a multiple of 256 (down_proj, K = 1536) plus a 2048 x 2048 matrix.

    python benchmarks/quant_kernels.py [--rows 1 8 16 32 64 128 256] [--reps 20]

Prints best-of-reps milliseconds and fp32 / kernel (above 1: the quantised kernel is faster).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.nn.functional as F

from common import best_ms
from deepinfer.engine.cpu_linear import CpuLinear
from deepinfer_kernels import quant

SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536), "sq 2048x2048": (2048, 2048)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--formats", nargs="+", default=["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help=f"of {list(SHAPES)}")
    ap.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    byname = {v[0]: k for k, v in quant.FORMATS.items()}
    print(f"threads={torch.get_num_threads()} avx2={quant.cpu_level()} PANEL_M={quant.PANEL_M}")
    print(f"{'shape':>17} {'fmt':>5} {'M':>4} {'fp32 ms':>8} {'row ex':>8} {'panel':>8} {'row i8':>8} "
          f"{'outer':>8} {'deq+dnn':>8} {'fp32/panel':>10} {'fp32/outer':>11} {'fp32/best q':>11}")
    gen = torch.Generator().manual_seed(0)
    for label in args.shapes:
        n, k = SHAPES[label]
        w = torch.randn(n, k, generator=gen) * 0.05
        lin = CpuLinear([w])
        for fname in args.formats:
            fmt = byname[fname]
            if k % quant.FORMATS[fmt][2]:
                continue
            qw = quant.pack(w, fmt)
            for m in args.rows:
                x = torch.randn(m, k, generator=gen)
                t = {"fp32": best_ms(lambda: lin(x, w), args.reps),
                     "row": best_ms(lambda: quant.qlinear(x, qw, mode="exact", panel=False), args.reps),
                     "panel": best_ms(lambda: quant.qlinear(x, qw, mode="exact", panel=True), args.reps),
                     "outer": best_ms(lambda: quant.qlinear_outer(x, qw), args.reps),
                     "i8": best_ms(lambda: quant.qlinear(x, qw, mode="int8"), args.reps),
                     "deq": best_ms(lambda: F.linear(x, quant.dequantize(qw)), args.reps)}
                best = min(t["row"], t["panel"], t["outer"], t["i8"])
                print(f"{label:>17} {fname:>5} {m:>4} {t['fp32']:>8.3f} {t['row']:>8.3f} {t['panel']:>8.3f} "
                      f"{t['i8']:>8.3f} {t['outer']:>8.3f} {t['deq']:>8.3f} {t['fp32'] / t['panel']:>10.2f} "
                      f"{t['fp32'] / t['outer']:>11.2f} {t['fp32'] / best:>11.2f}")


if __name__ == "__main__":
    main()
