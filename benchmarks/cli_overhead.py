"""Overhead of `deepinfer run` over `run_batch` on the extraction example (default model).

Three measurements over the same records (examples/data/reviews.jsonl, repeated to --records):
  a) `extract.run_batch(...)` in this process (max_in_flight = --batch-size);
  b) the job runner in this process on the same engine (`deepinfer.jobs.run_job`: streaming
     submission, result encoding, appends/fsyncs, progress);
  c) the `deepinfer run` command in a subprocess: its own records/s and tokens/s (from its
     summary line, model loaded) and its total wall time (process start, imports, model load).
Overhead = 1 - throughput(job) / throughput(run_batch); target < 5% for (b) and (c)'s own rate.

    python benchmarks/cli_overhead.py [--records 36] [--batch-size 64] [--max-tokens 80]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_input(path: str, n: int) -> None:
    rows = [json.loads(l) for l in open(os.path.join(ROOT, "examples", "data", "reviews.jsonl"))]
    with open(path, "w") as f:
        for i in range(n):
            r = rows[i % len(rows)]
            f.write(json.dumps({"id": f"{r['id']}-{i}", "text": r["text"]}) + "\n")


def tokens_of(states) -> int:
    return sum(st.get_meta_info("review")["completion_tokens"] for st in states if st.ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=36)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="alternate (a) and (b) this often; best time counts")
    args = ap.parse_args()

    import deepinfer as di
    from deepinfer.jobs import JobOptions, load_program, run_job

    tmp = tempfile.mkdtemp(prefix="cli_overhead_")
    inp = os.path.join(tmp, "in.jsonl")
    make_input(inp, args.records)
    extract = load_program(os.path.join(ROOT, "examples", "extract.py") + ":extract")
    engine = di.Engine(kv_cache_memory=args.kv_cache_mib << 20)
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens}
    rows = [json.loads(l) for l in open(inp)]
    extract.run_batch([{"text": rows[0]["text"]}], backend=engine, **sampling)  # warm-up

    rb_s = job_s = float("inf")
    for rep in range(args.repeats):  # alternate, so machine-load drift hits both alike
        engine.reset_prefix_cache()
        t = time.perf_counter()
        states = extract.run_batch([{"text": r["text"]} for r in rows], backend=engine,
                                   max_in_flight=args.batch_size, **sampling)
        rb_s = min(rb_s, time.perf_counter() - t)
        rb_tok = tokens_of(states)
        rb_fail = sum(not st.ok for st in states)

        engine.reset_prefix_cache()
        opts = JobOptions(input=inp, output=os.path.join(tmp, f"job{rep}.jsonl"), batch_size=args.batch_size,
                          sampling=sampling, progress=False)
        summary = run_job(extract, opts, engine)
        job_s, job_tok = min(job_s, summary.elapsed_s), summary.tokens

    out = os.path.join(tmp, "cli.jsonl")
    cmd = [sys.executable, "-m", "deepinfer", "run", os.path.join(ROOT, "examples", "extract.py") + ":extract",
           "--input", inp, "--output", out, "--batch-size", str(args.batch_size), "--temperature", "0",
           "--max-tokens", str(args.max_tokens), "--kv-cache-memory", str(args.kv_cache_mib), "--quiet"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    cli_wall = time.perf_counter() - t
    m = re.search(r"done: (\d+) records .*?, ([\d.]+)s, ([\d.]+) rec/s, ([\d.]+) tok/s", r.stderr)
    if m is None:
        raise SystemExit(f"could not parse the CLI's summary (exit {r.returncode}):\n{r.stderr}")
    cli_s, cli_rps, cli_tps = float(m[2]), float(m[3]), float(m[4])

    n = args.records
    print(f"{n} records, batch {args.batch_size}, max_tokens {args.max_tokens}, best of {args.repeats} "
          f"(failed in run_batch: {rb_fail}); machine load inflates every figure")
    print(f"  run_batch          : {rb_s:7.2f}s  {n / rb_s:6.2f} rec/s  {rb_tok / rb_s:7.1f} tok/s")
    print(f"  run_job in-process : {job_s:7.2f}s  {n / job_s:6.2f} rec/s  {job_tok / job_s:7.1f} tok/s"
          f"  overhead {100 * (1 - (n / job_s) / (n / rb_s)):+.1f}% (rec/s)")
    print(f"  deepinfer run (own): {cli_s:7.2f}s  {cli_rps:6.2f} rec/s  {cli_tps:7.1f} tok/s"
          f"  overhead {100 * (1 - cli_rps / (n / rb_s)):+.1f}% (rec/s)")
    print(f"  deepinfer run total wall (start, imports, model load): {cli_wall:.2f}s")


if __name__ == "__main__":
    main()
