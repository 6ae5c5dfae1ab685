"""Where the default mode should switch from the row kernel to the outer-product kernel (OUTER_M in
deepinfer/engine/quant_linear.py), and the outer kernel's AVX-512 tile against its AVX2 tile: per
SmolLM2-135M shape and row count, the row kernel (exact, what QuantLinear runs below OUTER_M), the
outer kernel, and the int8 row kernel, each at the CPU's level and capped to its AVX2 code
(quant.set_level_cap(1)), the bf16 mode's kernel (quant.qlinear_bf16: bf16 products, AVX512_BF16; where
to switch to it is BF16_M in quant_linear.py), the int8 mode's outer kernel (quant.qlinear_int8_outer:
the level's kernel, quant.int8_outer_kernel, i.e. AVX512_VNNI's vpdpbusd tiles on an AVX-512 VNNI host,
and capped to its AVX2 kernel, vpmaddubsw / vpmaddwd; where to switch to it is INT8_OUTER_M there), and the
fp32 engine's own GEMM (CpuLinear) on the same weights. Arms alternate within each repetition; median ms.
DEEPINFER_CPU=avx2 runs the avx2 build of the library (what an AVX2-only CPU runs): there every arm is
the AVX2 code.

    python benchmarks/quant_outer_m.py [--rows 1 2 4 8 12 16 32 128] [--reps 15] [--fmt Q4_1] [--lm-head-fmt Q8_0]
        [--arms row outer i8 i8o i8o2 bf16 fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.engine.cpu_linear import CpuLinear
from deepinfer_kernels import quant

ARMS = ("row", "row2", "outer", "outer2", "i8", "i82", "i8o", "i8o2", "bf16", "fp32")
# (a, b) printed as time(a) / time(b) where both arms run
RATIOS = (("row", "outer"), ("row2", "row"), ("outer2", "outer"), ("i82", "i8"), ("fp32", "outer"),
          ("row", "bf16"), ("outer", "bf16"), ("fp32", "bf16"),
          ("i8", "i8o"), ("outer", "i8o"), ("bf16", "i8o"), ("i82", "i8o2"), ("outer2", "i8o2"))
SHAPES = {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "lm_head 49152x576": (49152, 576)}


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 128])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fmt", default="Q4_1")
    ap.add_argument("--lm-head-fmt", default="Q8_0", help="the tied LM head's format (Q8_0 in SmolLM2's Q4_1 GGUF)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="which kernels to time")
    args = ap.parse_args()
    byname = {v[0]: k for k, v in quant.FORMATS.items()}
    level = quant.cpu_level()
    probe = quant.pack(torch.zeros(1, 32), byname[args.fmt])
    kernels = [quant.int8_outer_kernel(probe)]
    quant.set_level_cap(1)
    kernels.append(quant.int8_outer_kernel(probe))
    quant.set_level_cap(None)
    print(f"threads={torch.get_num_threads()} level={level} fmt={args.fmt} lm_head={args.lm_head_fmt} "
          f"int8 outer kernels: i8o={kernels[0]} i8o2={kernels[1]}")
    print("ms, median; '2' = capped to the AVX2 code (quant.set_level_cap(1)); i8 = int8 row kernel; "
          "i8o = quant.qlinear_int8_outer (the int8 mode's outer kernel at the level); bf16 = quant.qlinear_bf16; "
          "a/b: time of a over time of b")
    pairs = [(a, b) for a, b in RATIOS if a in args.arms and b in args.arms]
    print(f"{'shape':>18} {'M':>4} " + " ".join(f"{a:>7}" for a in args.arms) + " " +
          " ".join(f"{a + '/' + b:>11}" for a, b in pairs))
    gen = torch.Generator().manual_seed(0)
    for label in args.shapes:
        n, k = SHAPES[label]
        w = torch.randn(n, k, generator=gen) * 0.05
        lin = CpuLinear([w])
        qw = quant.pack(w, byname[args.lm_head_fmt if label.startswith("lm_head") else args.fmt])
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)

            def capped(fn):
                def run():
                    quant.set_level_cap(1)
                    try:
                        fn()
                    finally:
                        quant.set_level_cap(None)
                return run

            row = lambda: quant.qlinear(x, qw, mode="exact", panel=False)  # noqa: E731
            i8 = lambda: quant.qlinear(x, qw, mode="int8")  # noqa: E731
            outer = lambda: quant.qlinear_outer(x, qw)  # noqa: E731
            bf16 = lambda: quant.qlinear_bf16(x, qw)  # noqa: E731
            i8o = lambda: quant.qlinear_int8_outer(x, qw)  # noqa: E731
            every = {"row": row, "row2": capped(row), "outer": outer, "outer2": capped(outer),
                     "i8": i8, "i82": capped(i8), "i8o": i8o, "i8o2": capped(i8o), "bf16": bf16,
                     "fp32": lambda: lin(x, w)}
            arms = {a: every[a] for a in args.arms}
            t = {a: [] for a in arms}
            for fn in arms.values():
                fn()
            for i in range(args.reps):
                order = list(arms) if i % 2 == 0 else list(reversed(arms))
                for a in order:
                    t[a].append(_ms(arms[a]))
            md = {a: statistics.median(v) for a, v in t.items()}
            print(f"{label:>18} {m:>4} " + " ".join(f"{md[a]:>7.3f}" for a in arms) + " " +
                  " ".join(f"{md[a] / md[b]:>11.2f}" for a, b in pairs), flush=True)


if __name__ == "__main__":
    main()
