"""The engine's host time per decode step, by part, and the device's idle share, on a simulated device
whose every step takes T ms (deepinfer/testing/simulated_device.py: what the host would cost beside a
GPU) and on the real default model (--real), synchronous and overlapped, unconstrained and with a JSON
schema on every request (issue 50).

    python benchmarks/host_overhead.py [--batches 1 64 256 1024] [--T-ms 2 5 10] [--steps 32]
                                       [--simulated] [--real] [--loops sync overlap]
                                       [--workloads unconstrained json] [--json]

Each row runs `batch` requests of `steps` + 1 new tokens (greedy; unconstrained rows ignore EOS, JSON
rows may end sooner when their object closes) and measures the decode window only: from the step
after every prompt was planned to the last output. In it:
- host time: the wall time the engine's calling thread did not spend waiting for the device (sync: the
  window less the device's busy time, since the loop waits for every forward; overlap: the window less
  `stats.wait_time`); `host_us_per_seq` is that per sequence-step (per token: no speculation);
- parts, in ms per step, from `engine.stats` (engine/stats.py): schedule (admission + Scheduler),
  prepare (plan_step + the runner's prepare), draft, mask (grammar mask fill: while sampling, and in
  the overlapped loop for the next step during post-processing), sample (the rest of StepSampler:
  sampling params, argmax / draws over the logits), output (OutputProcessor: matchers, stop checks,
  less detokenise), detok (incremental detokenisation) and other (the rest of the host time: the
  compute-thread handoff, releasing finished sequences, the stand-in's launch);
- device_idle: 1 - the device's busy time / the window; device_ms: its busy time per step (the simulated
  device: max(T, the time its process took to write the step's logits rows), see simulated_device.py),
  write_ms that write's time (the stand-in's own work, not the engine's) and late_ms how long after the
  modelled end the rows were really there (the process, at idle priority, found no free core: other
  jobs on the machine; a row with a large late_ms measured the machine, not the engine);
- tokens_per_s over the window; valid: the share of JSON outputs that validate (capped at steps + 1
  tokens, most objects are cut short: the simulated device's draws are uniform over what the grammar
  allows, whitespace included, so its objects run to ~40-60 tokens; --json-tokens 200 lets them close).
On --real the device is this CPU's forward pass (T_ms null) and the host shares its cores.
No number here is asserted anywhere; ratios are only comparable within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import make_prompts  # noqa: E402
from deepinfer import SamplingParams  # noqa: E402

SCHEMA = {  # benchmarks/overlap.py's
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 24}, "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
                   "keywords": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["topic", "difficulty", "keywords"],
}
COUNTERS = ("num_steps", "generated_tokens", "forward_time", "wait_time", "schedule_time", "prepare_time", "draft_time",
            "sample_time", "mask_time", "mask_prefill_time", "postprocess_time", "detokenize_time",
            "prompt_tokens", "computed_prompt_tokens", "cached_prompt_tokens")
PARTS = ("schedule", "prepare", "draft", "mask", "sample", "output", "detok", "other")
KV_BYTES_PER_TOKEN = 46080  # the default model's fp32 KV: 30 layers x K and V x 3 heads x 64 x 4 bytes
PROMPT_TOKENS = 64  # at most, per prompt (chat template included), for sizing the real engine's KV cache


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def snapshot(engine) -> dict:
    s = engine.stats
    write = getattr(engine.runner, "write_time", 0.0)  # the simulated device's process, busy on steps
    late = getattr(engine.runner, "late_time", 0.0)  # its rows there after the modelled step's end
    return {"t": time.perf_counter(), "device_write": write, "device_late": late,
            **{k: getattr(s, k) for k in COUNTERS}}


def workload(name: str, batch: int, steps: int, json_tokens: int | None = None):
    prompts = make_prompts(batch, seed=batch)
    if name == "json":
        chat = [[{"role": "user", "content": p + " Answer as JSON."}] for p in prompts]
        return chat, SamplingParams(temperature=0, max_tokens=json_tokens or steps + 1, json_schema=SCHEMA)
    return prompts, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)


def run_row(engine, name: str, batch: int, steps: int, json_tokens: int | None = None) -> dict:
    """One measured run: the decode window's counters (see the module docstring)."""
    prompts, sp = workload(name, batch, steps, json_tokens)
    engine.reset_prefix_cache()
    # what generate() does: while it runs, a step builds outputs for finished requests only
    engine._finished_outputs_only = True
    outs = []
    try:
        p0 = snapshot(engine)
        for p in prompts:
            engine.add_request(p, sp)
        start, armed = None, False
        while engine.has_unfinished():
            outs += engine.step()
            if start is None:
                s = engine.stats
                planned = s.computed_prompt_tokens + s.cached_prompt_tokens - p0["computed_prompt_tokens"] \
                    - p0["cached_prompt_tokens"] >= s.prompt_tokens - p0["prompt_tokens"]
                # every prompt planned: the window opens after this step (overlapped: after the next one,
                # which reads the last prefill's samples)
                if planned and engine.config.overlap_schedule and not armed:
                    armed = True
                elif planned:
                    start = snapshot(engine)
        end = snapshot(engine)
    finally:
        engine._finished_outputs_only = False
    if start is None:  # (every request ended in its prefill step)
        start = end
    d = {k: end[k] - start[k] for k in end}
    return {"d": d, "outs": outs, "sp": sp}


def row_record(device: str, T_ms, loop: str, name: str, batch: int, r: dict) -> dict:
    d = r["d"]
    wall, steps, seqs = d["t"], max(d["num_steps"], 1), max(d["generated_tokens"], 1)
    busy = d["forward_time"]
    host = wall - (busy if loop == "sync" else d["wait_time"])
    parts = {
        "schedule": d["schedule_time"] - d["prepare_time"] - d["draft_time"],
        "prepare": d["prepare_time"],
        "draft": d["draft_time"],
        "mask": d["mask_time"] + d["mask_prefill_time"],
        "sample": d["sample_time"] - d["mask_time"],
        "output": d["postprocess_time"] - d["detokenize_time"] - d["mask_prefill_time"],
        "detok": d["detokenize_time"],
    }
    parts["other"] = host - sum(parts.values())
    valid = None
    if name == "json":
        vs = [o.valid for o in r["outs"]]
        valid = round(sum(bool(v) for v in vs) / len(vs), 3) if vs else None
    return {
        "device": device, "batch": batch, "T_ms": T_ms, "loop": loop, "constrained": name == "json",
        "host_us_per_seq": round(host / seqs * 1e6, 2),
        "device_idle": round(max(0.0, 1.0 - busy / wall), 4) if wall > 0 else None,
        "tokens_per_s": round(d["generated_tokens"] / wall, 1) if wall > 0 else None,
        "host_ms_per_step": round(host / steps * 1e3, 3),
        "device_ms_per_step": round(busy / steps * 1e3, 3),
        "device_write_ms_per_step": round(d["device_write"] / steps * 1e3, 3) if device == "simulated" else None,
        "device_late_ms_per_step": round(d["device_late"] / steps * 1e3, 3) if device == "simulated" else None,
        "parts_ms_per_step": {k: round(v / steps * 1e3, 3) for k, v in parts.items()},
        "steps": d["num_steps"], "mean_batch": round(d["generated_tokens"] / steps, 1), "valid": valid,
    }


def print_row(rec: dict) -> None:
    p = rec["parts_ms_per_step"]
    T = "-" if rec["T_ms"] is None else f"{rec['T_ms']:g}"
    print(f"{rec['device']:>9} {T:>4} {rec['loop']:>7} {'json' if rec['constrained'] else 'free':>4} {rec['batch']:>5} "
          f"{rec['tokens_per_s']:>9.1f} {rec['host_us_per_seq']:>9.1f} {rec['device_idle']:>6.1%} "
          f"{rec['host_ms_per_step']:>8.2f} {rec['device_ms_per_step']:>7.2f} "
          + "".join(f"{'-' if rec[k] is None else format(rec[k], '.2f'):>8}"
                    for k in ("device_write_ms_per_step", "device_late_ms_per_step")) + "  "
          + " ".join(f"{p[k]:>7.2f}" for k in PARTS)
          + f"  {'' if rec['valid'] is None else rec['valid']}", flush=True)


HEADER = (f"{'device':>9} {'T_ms':>4} {'loop':>7} {'work':>4} {'batch':>5} {'tok/s':>9} {'host_us/s':>9} {'idle':>6} "
          f"{'host_ms':>8} {'dev_ms':>7} {'write_ms':>7} {'late_ms':>7}  " + " ".join(f"{k:>7}" for k in PARTS) + "  valid")


def warm(engine) -> None:
    """First-use costs out of the rows: the native kernels, the tokenizer, the schema's compile."""
    engine.generate(make_prompts(2), SamplingParams(temperature=0, max_tokens=3))
    engine.generate([[{"role": "user", "content": "Hi. Answer as JSON."}]] * 2,
                    SamplingParams(temperature=0, max_tokens=3, json_schema=SCHEMA))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--T-ms", dest="T_ms", type=float, nargs="+", default=[2.0, 5.0, 10.0],
                    help="the simulated device's step times")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per row (new tokens - 1)")
    ap.add_argument("--json-tokens", type=int, default=None,
                    help="max_tokens of the JSON rows (default steps + 1: the batch stays full, objects may be cut)")
    ap.add_argument("--simulated", action="store_true", help="rows on the simulated device (the default)")
    ap.add_argument("--real", action="store_true", help="rows on the real default model")
    ap.add_argument("--loops", nargs="+", choices=["sync", "overlap"], default=["sync", "overlap"])
    ap.add_argument("--workloads", nargs="+", choices=["unconstrained", "json"], default=["unconstrained", "json"])
    ap.add_argument("--speculative", choices=["ngram"], default=None, help="with n-gram drafts (the draft part)")
    ap.add_argument("--threads", type=int, default=None,
                    help="the engine's num_threads (default: 1 on the simulated device, every core on --real)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args()
    if min(args.batches) < 1 or args.steps < 1 or min(args.T_ms) < 0:
        ap.error("--batches and --steps must be >= 1 and --T-ms >= 0")
    sims = args.simulated or not args.real
    cpu = cpu_name()
    max_b = max(args.batches)
    common = dict(max_num_seqs=max_b, speculative=args.speculative)
    # The simulated device's process writes each step's logits on the second core, and on a GPU host the
    # engine's sampling would be device work: its host side is one thread. With two OpenMP threads here,
    # every parallel region waits whenever the other core is taken (by the device's process or any other
    # job): native.argmax_rows took 4-8 ms at batch 2-256 with two threads beside another busy process,
    # 0.016 / 0.41 / 1.85 ms at batch 2 / 64 / 256 with one.
    sim_threads = args.threads or 1
    real_threads = args.threads or os.cpu_count()
    if not args.json:
        print(f"CPU: {cpu}; {args.steps} decode steps per row; host threads {sim_threads} simulated, {real_threads} real; "
              "times per step in ms; host_us/s: us per sequence-step")
        print(HEADER)

    def emit(rec: dict) -> None:
        rec["cpu"] = cpu
        rec["threads"] = sim_threads if rec["device"] == "simulated" else real_threads
        if args.json:
            print(json.dumps(rec), flush=True)
        else:
            print_row(rec)

    def rows(make, device: str, Ts) -> None:
        for loop in args.loops:
            engine = make(loop == "overlap")
            try:
                warm(engine)
                for T in Ts:
                    if T is not None:
                        engine.set_step_ms(T)
                    for b in args.batches:
                        for w in args.workloads:
                            emit(row_record(device, T, loop, w, b, run_row(engine, w, b, args.steps, args.json_tokens)))
            finally:
                engine.close()
                # gone before the next engine is built: with the synchronous engine (its sequences, buffers)
                # still alive, the overlapped engine's batch-256 sampling ran 9.3 ms a step instead of 2.5
                del engine
                gc.collect()

    if sims:
        from deepinfer.testing.simulated_engine import simulated_engine

        rows(lambda ov: simulated_engine(args.T_ms[0], overlap_schedule=ov, num_threads=sim_threads, **common),
             "simulated", args.T_ms)
    if args.real:
        from deepinfer import Engine

        kv = max(256 << 20, max_b * (PROMPT_TOKENS + args.steps + 8) * KV_BYTES_PER_TOKEN)
        rows(lambda ov: Engine(kv_cache_memory=kv, overlap_schedule=ov, num_threads=real_threads, **common), "cpu", [None])


if __name__ == "__main__":
    main()
