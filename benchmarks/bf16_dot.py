"""The bf16-dot path (Engine(dtype="bfloat16") on CPU): its projection kernel (csrc/gemm_bf16dot.c) against the
fp32 panel GEMM (csrc/gemm.c) and its bf16-widening build (gemm_bf16.c: the same bf16 panels widened to
fp32, dtype="auto" on a bf16 checkpoint), per SmolLM2-135M projection shape and row count.

Weights come from memory as in a decode step: each call takes the next of several copies (> 64 MB of
each arm's panels in all; the LM head is one copy, 57-113 MB). Per (shape, rows) the three arms run
in turn, the order reversed every other repeat; each repeat times `--iters` calls and keeps their
median; the table gives each arm's median over the repeats, the spread (min-max over repeats) of
the bf16-dot arm, and the ratios of medians (bf16-dot / fp32 as a speed-up: t_fp32 / t_dot).

    python benchmarks/bf16_dot.py [--rows 1 8 32 128 512] [--repeats 5] [--iters 20] [--fallback]
    python benchmarks/bf16_dot.py --accuracy DIR [--prompts 8] [--new-tokens 32]

--fallback times the kernel's widening fallback (what runs without AVX512_BF16) instead of vdpbf16ps.
--accuracy: Engine(DIR, dtype="bfloat16") against dtype="float32" on common.make_prompts: greedy
agreement (prompts whose new tokens are all equal, and the mean length of the common prefix), and the
max |logprob difference| of the chosen tokens over prompt + float32's continuation, teacher-forced
(prompt_logprobs of both engines on the same ids).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch

from common import make_prompts, run_on_compute_thread

from deepinfer import Engine, SamplingParams
from deepinfer_kernels import native

# (name, N, K, gated): attention o, fused qkv, gate_up (gated: 2 x 1536), down, tied LM head
SHAPES = [("o 576x576", 576, 576, False), ("qkv 960x576", 960, 576, False), ("gate_up 2x1536x576", 3072, 576, True),
          ("down 576x1536", 576, 1536, False), ("lm_head 49152x576", 49152, 576, False)]


def _arms(n: int, k: int, gated: bool, gen: torch.Generator):
    pack = native.pack_gated_weight if gated else native.pack_weight
    run = native.gated_linear if gated else native.linear
    copies = max(1, (64 << 20) // (n * k * 2) + 1) if n * k < (16 << 20) else 1
    ws = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(copies)]
    arms = {
        "fp32": [pack(w) for w in ws],
        "bf16-widen": [pack(w.bfloat16()) for w in ws],
        "bf16-dot": [pack(w, bf16_dot=True) for w in ws],
    }
    return run, arms


def _time(run, x, packed, iters: int) -> float:
    times = []
    for i in range(iters):
        pw = packed[i % len(packed)]
        t0 = time.perf_counter()
        run(x, pw)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def accuracy(model: str, n_prompts: int, new_tokens: int) -> None:
    prompts = make_prompts(n_prompts, seed=11)
    engines = {d: Engine(model, dtype=d, kv_cache_memory=256 << 20) for d in ("float32", "bfloat16")}
    print(f"{model}: precisions {', '.join(e.precision for e in engines.values())}")
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    out = {d: [o.token_ids for o in e.generate(prompts, sp)] for d, e in engines.items()}
    prefix = []
    for a, b in zip(out["float32"], out["bfloat16"]):
        prefix.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    same = sum(p == new_tokens for p in prefix)
    print(f"greedy agreement: {same}/{n_prompts} prompts x {new_tokens} tokens identical; common prefix "
          f"mean {statistics.mean(prefix):.1f}, min {min(prefix)} tokens")
    f32 = engines["float32"]
    ids = [f32.encode_prompt(p) + t for p, t in zip(prompts, out["float32"])]
    lp = {d: [o.prompt_logprobs for o in e.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0))]
          for d, e in engines.items()}
    diffs = [abs(a.logprob - b.logprob) for ra, rb in zip(lp["float32"], lp["bfloat16"])
             for a, b in zip(ra, rb) if a is not None]
    print(f"teacher-forced logprobs over {len(diffs)} positions: max |diff| {max(diffs):.4f}, "
          f"median {statistics.median(diffs):.4f}, 99th pct {sorted(diffs)[int(0.99 * len(diffs))]:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", nargs="+", default=None, help="a subset of the shape names' first words")
    ap.add_argument("--fallback", action="store_true", help="time the widening fallback, not vdpbf16ps")
    ap.add_argument("--accuracy", metavar="DIR", default=None, help="engine accuracy vs float32 on this model")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    if args.accuracy:
        accuracy(args.accuracy, args.prompts, args.new_tokens)
        return
    native.set_bf16_dot_cap(0 if args.fallback else None)
    print(f"threads {torch.get_num_threads()}, bf16-dot level {native.bf16_dot_level()} "
          f"({'vdpbf16ps' if native.bf16_dot_level() else 'widening fallback'})")
    print(f"{'shape':<20} {'rows':>5} {'fp32 us':>10} {'widen us':>10} {'dot us':>10} {'dot spread':>17} "
          f"{'dot/fp32':>9} {'dot/widen':>9} {'dot GFLOP/s':>11}")
    gen = torch.Generator().manual_seed(0)
    for name, n, k, gated in SHAPES:
        if args.shapes and name.split()[0] not in args.shapes:
            continue
        run, arms = _arms(n, k, gated, gen)
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            for packed in arms.values():  # warm-up
                _time(run, x, packed, 2)
            t = {a: [] for a in arms}
            order = list(arms)
            for r in range(args.repeats):
                for a in order if r % 2 == 0 else order[::-1]:
                    t[a].append(_time(run, x, arms[a], args.iters))
            med = {a: statistics.median(v) for a, v in t.items()}
            flop = 2 * m * n * k
            print(f"{name:<20} {m:>5} {med['fp32'] * 1e6:>10.1f} {med['bf16-widen'] * 1e6:>10.1f} "
                  f"{med['bf16-dot'] * 1e6:>10.1f} {min(t['bf16-dot']) * 1e6:>8.1f}-{max(t['bf16-dot']) * 1e6:<8.1f} "
                  f"{med['fp32'] / med['bf16-dot']:>9.2f} {med['bf16-widen'] / med['bf16-dot']:>9.2f} "
                  f"{flop / med['bf16-dot'] / 1e9:>11.1f}", flush=True)
        del arms


if __name__ == "__main__":
    run_on_compute_thread(main)  # (common.py: one OpenMP thread for engine and reference)
