"""Overlapped vs synchronous engine loop, side by side on the default model, at batch 64, with and
without grammar constraints: throughput, and the idle gap between forward passes as a share of
wall time (target: under 5% overlapped).

    python benchmarks/overlap.py [--batch 64] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import make_prompts
from deepinfer import Engine, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 24}, "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
                   "keywords": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["topic", "difficulty", "keywords"],
}


def run(engine: Engine, prompts, sp):
    s = engine.stats
    engine.reset_prefix_cache()
    s.last_forward_end = 0.0  # the gap before this run's first forward is not this run's
    gap0, steps0, jf0 = s.idle_gap_time, s.num_steps, s.jump_forward_tokens
    t = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t
    toks = sum(len(o.token_ids) for o in outs)
    # idle share over this run only: gaps between its forward passes / wall time of the run
    gap = s.idle_gap_time - gap0
    return toks / dt, gap / dt, outs, s.num_steps - steps0, s.jump_forward_tokens - jf0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    prompts = make_prompts(args.batch, seed=5)
    chat = [[{"role": "user", "content": p + " Answer as JSON."}] for p in prompts]
    engines = {mode: Engine(kv_cache_memory=1 << 30, overlap_schedule=(mode == "overlap")) for mode in ("sync", "overlap")}
    for e in engines.values():
        e.generate(make_prompts(2), SamplingParams(max_tokens=2))
    workloads = {
        "unconstrained": (prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)),
        "json-schema": (chat, SamplingParams(temperature=0, max_tokens=args.new_tokens * 2, json_schema=SCHEMA)),
    }
    for name, (ps, sp) in workloads.items():
        res = {m: run(e, ps, sp) for m, e in engines.items()}
        same = [o.token_ids for o in res["sync"][2]] == [o.token_ids for o in res["overlap"][2]]
        print(f"{name:>14}: sync {res['sync'][0]:.1f} tok/s (idle {res['sync'][1]:.1%}), "
              f"overlap {res['overlap'][0]:.1f} tok/s (idle {res['overlap'][1]:.1%}), "
              f"speed-up {res['overlap'][0] / res['sync'][0]:.2f}x, identical outputs: {same}; "
              f"steps {res['sync'][3]} vs {res['overlap'][3]}, jump-forward tokens {res['sync'][4]}")


if __name__ == "__main__":
    main()
