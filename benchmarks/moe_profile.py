"""Where a step of the MoE benchmark models spends its time: one prefill step and the decode steps
after it at `--batch` sequences, split into MLA/attention, router, grouped experts, shared experts,
dense MLP layers, norms, the LM head, the sampler and the rest (Python, scheduling, bookkeeping).

Split by wrapping the model's modules' methods with wall-clock timers (nested time is charged to
the innermost category only), plus a cProfile top list (`--cprofile`) and a torch profiler op
table (`--torch-profile`). The same models as benchmarks/moe.py. Shares, not absolute times, are
the point: the machine is shared.

    python benchmarks/moe_profile.py [--models v3 qwen3] [--batch 32] [--decode-steps 6] [--cprofile] [--torch-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))

from common import run_on_compute_thread

import torch

from deepinfer import Engine, SamplingParams


class Timers:
    """Exclusive wall time per category: time inside a nested timed call goes to the inner category."""

    def __init__(self):
        self.total = defaultdict(float)
        self._stack: list[list] = []  # [category, start, time spent in children]

    def wrap(self, obj, attr: str, category: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **k):
            self._stack.append([category, time.perf_counter(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                cat, t0, inner = self._stack.pop()
                dt = time.perf_counter() - t0
                self.total[cat] += dt - inner
                if self._stack:
                    self._stack[-1][2] += dt

        setattr(obj, attr, timed)

    def reset(self) -> None:
        self.total.clear()


def instrument(engine: Engine, timers: Timers) -> None:
    from deepinfer.engine.models.layers import GatedMLP, RMSNorm
    from deepinfer.engine.models.moe import MoeBlock

    model = engine.runner.model
    shared = {id(m.shared) for m in model.modules() if isinstance(m, MoeBlock) and m.shared is not None}
    for m in model.modules():
        if isinstance(m, MoeBlock):
            timers.wrap(m, "route", "router")
            timers.wrap(m, "grouped_experts", "grouped experts")
            timers.wrap(m, "forward", "moe combine")
        elif isinstance(m, GatedMLP):
            timers.wrap(m, "forward", "shared experts" if id(m) in shared else "dense MLP layers")
        elif isinstance(m, RMSNorm):
            timers.wrap(m, "forward", "norms")
        elif type(m).__name__ in ("MlaAttention", "Attention"):
            timers.wrap(m, "forward", "attention (MLA/GQA)")
    runner = engine.runner
    for name in ("compute_logits", "logits"):
        if hasattr(runner, name):
            timers.wrap(runner, name, "lm head")
            break
    if hasattr(model, "compute_logits"):
        timers.wrap(model, "compute_logits", "lm head")
    timers.wrap(engine.runner, "forward", "runner other")
    sampler = getattr(engine, "step_sampler", None) or getattr(engine, "_step_sampler", None)
    if sampler is not None:
        timers.wrap(sampler, "sample", "sampler")


def report(label: str, timers: Timers, wall: float, steps: int) -> None:
    print(f"  {label}: {steps} step(s), {wall / steps * 1e3:.1f} ms/step")
    rows = sorted(timers.total.items(), key=lambda kv: -kv[1])
    accounted = sum(timers.total.values())
    for cat, t in rows:
        print(f"    {cat:<22} {t / steps * 1e3:8.2f} ms  {t / wall * 100:5.1f}%")
    rest = wall - accounted
    print(f"    {'python/scheduler rest':<22} {rest / steps * 1e3:8.2f} ms  {rest / wall * 100:5.1f}%")


def main() -> None:
    from moe import build

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["v3", "qwen3"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--torch-profile", action="store_true")
    args = ap.parse_args()
    print(f"threads={torch.get_num_threads()} batch={args.batch} (shared, loaded machine: read the shares)")
    with tempfile.TemporaryDirectory() as root:
        for kind in args.models:
            engine = Engine(build(kind, root), kv_cache_memory=256 << 20)
            vocab = engine.model_config.vocab_size
            engine.generate([[5] * 16] * 2, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
            timers = Timers()
            instrument(engine, timers)
            g = torch.Generator().manual_seed(1234)
            ids = torch.randint(3, vocab, (args.batch, 16), generator=g).tolist()
            sp = SamplingParams(temperature=0, max_tokens=args.decode_steps + 1, ignore_eos=True)
            for i, p in enumerate(ids):
                engine.add_request(p, sp, request_id=f"p{i}")
            print(f"\n{kind}: linear={getattr(engine.runner.linear, 'backend', 'torch')}")
            prof = cProfile.Profile() if args.cprofile else None
            t = time.perf_counter()
            engine.step()  # the whole batch's prefill (16 tokens each fit one step's budget)
            report("prefill", timers, time.perf_counter() - t, 1)
            timers.reset()
            tp = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.torch_profile else None
            if tp is not None:
                tp.__enter__()
            if prof is not None:
                prof.enable()
            t = time.perf_counter()
            n = 0
            while engine.has_unfinished():
                engine.step()
                n += 1
            wall = time.perf_counter() - t
            if prof is not None:
                prof.disable()
            if tp is not None:
                tp.__exit__(None, None, None)
            report("decode", timers, wall, n)
            if prof is not None:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
                print("\n".join(s.getvalue().splitlines()[6:30]))
            if tp is not None:
                print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            del engine


if __name__ == "__main__":
    run_on_compute_thread(main)  # (common.py: one OpenMP thread for engine and reference)
