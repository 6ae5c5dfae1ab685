"""Where a decode step's time goes on a CUDA device: the host's Python (cProfile) and the device's
kernels (torch.profiler), at one batch size, for the 0.5B Qwen3-shaped model of gpu_engine_check.py
(--model dense) or benchmarks/moe.py's Qwen3-MoE-shaped one in bf16 (--model moe).

    python scripts/gpu_step_profile.py [--model dense|moe] [--batch 1] [--new-tokens 32] [--graphs] [--overlap]

Prints: the launch cost of a plain torch op on this machine (a floor for an eager forward), the
run's tokens/s, the host functions by own time, and the device ops by their CUDA time per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import torch

from deepinfer import Engine, SamplingParams


def launch_floor(dev) -> None:
    x = torch.ones(1024, device=dev)
    for _ in range(100):
        x = x * 1.0
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        x = x * 1.0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"2000 tiny torch ops: {(t1 - t) * 1e6 / 2000:.1f} us each to launch, {(t2 - t) * 1e3:.1f} ms to finish; "
          f"torch threads {torch.get_num_threads()}")


def main() -> None:
    import gpu_engine_check as g

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", choices=["dense", "moe"], default="dense")
    args = ap.parse_args()
    dev = "cuda"
    launch_floor(dev)
    root = pathlib.Path(tempfile.mkdtemp())
    if args.model == "moe":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import moe as bench

        path = bench.build("qwen3", str(root), torch.bfloat16)
    else:
        path = g.qwen3_shaped(root, args.tiny)
    kw = {"cuda_graphs": True} if args.graphs else {}
    eng = Engine(str(path), device=dev, kv_cache_memory=4 << 30, overlap_schedule=args.overlap, **kw)
    sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = [[3 + (31 * i + 7 * j) % 370 for j in range(16)] for i in range(args.batch)]  # token ids: any vocab
    eng.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    eng.reset_prefix_cache()
    t = time.perf_counter()
    eng.generate(prompts, sp)
    dt = time.perf_counter() - t
    print(f"batch {args.batch}: {args.batch * args.new_tokens / dt:.0f} tok/s, {dt / args.new_tokens * 1e3:.1f} ms a step")
    eng.reset_prefix_cache()
    pr = cProfile.Profile()
    pr.enable()
    eng.generate(prompts, sp)
    pr.disable()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumtime").print_stats(45)
    eng.reset_prefix_cache()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        eng.generate(prompts, sp)
    for key in ("self_device_time_total", "self_cpu_time_total"):
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=25))
        except Exception as e:  # the sort keys' names moved between torch versions
            print(f"sort by {key}: {e!r}")


if __name__ == "__main__":
    main()
