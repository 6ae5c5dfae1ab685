"""Batch-invariant mode: its cost, and what it buys, side by side on the default model.

1. Throughput (output tokens/s) at batch 32 with batch_invariant=True vs the default (target >= 0.8).
2. One prompt run many times inside batches of varied size and content, the prompt at a random
   position (seeded sampling): the number of distinct completions in each mode (target: 1 when
   batch-invariant).

    python benchmarks/determinism.py [--batch 32] [--runs 200] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import make_prompts
from deepinfer import Engine, SamplingParams


def throughput(engine: Engine, batch: int, new_tokens: int) -> float:
    prompts = make_prompts(batch, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    t = time.perf_counter()
    engine.generate(prompts, sp)
    return batch * new_tokens / (time.perf_counter() - t)


def distinct_completions(engine: Engine, runs: int, max_batch: int, new_tokens: int, seed: int = 0) -> int:
    r = random.Random(seed)
    target = [{"role": "user", "content": "Write one sentence about the ocean."}]
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=new_tokens)
    pool = make_prompts(256, seed=11)
    seen = set()
    for _ in range(runs):
        n = r.randint(1, max_batch)
        others = r.sample(pool, n - 1)
        pos = r.randint(0, n - 1)
        prompts = others[:pos] + [target] + others[pos:]
        params = [SamplingParams(temperature=0.7, max_tokens=r.randint(1, new_tokens), seed=r.randint(0, 1 << 30))
                  for _ in prompts]
        params[pos] = sp
        if r.random() < 0.5:
            engine.reset_prefix_cache()
        seen.add(tuple(engine.generate(prompts, params)[pos].token_ids))
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=16)
    args = ap.parse_args()
    default = Engine(kv_cache_memory=1 << 30)
    inv = Engine(kv_cache_memory=1 << 30, batch_invariant=True)
    for e in (default, inv):
        e.generate(make_prompts(2), SamplingParams(max_tokens=2))
    t_def = throughput(default, args.batch, args.new_tokens)
    t_inv = throughput(inv, args.batch, args.new_tokens)
    print(f"batch {args.batch}: default {t_def:.1f} tok/s, batch-invariant {t_inv:.1f} tok/s, "
          f"ratio {t_inv / t_def:.2f} (target >= 0.8)")
    d_def = distinct_completions(default, args.runs, args.max_batch, 16)
    d_inv = distinct_completions(inv, args.runs, args.max_batch, 16)
    print(f"distinct completions of one seeded prompt over {args.runs} varied batches: "
          f"default {d_def}, batch-invariant {d_inv} (target 1)")


if __name__ == "__main__":
    main()
