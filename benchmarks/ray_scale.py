"""Benchmark (not a test): records/s of one job run plainly vs `--ray` with 1 and 2 replicas.

All three in one process, side by side, on the same records and model; a local Ray cluster
with --cpus CPUs. Each engine gets the same CPU share per run: the plain run and the 1-replica
actor use --cpus torch threads, each of 2 replicas --cpus / 2. The plain run is timed before and after the Ray runs (ratios use their mean: other
work on a shared machine drifts). Rates are the job's own (model
loaded, replicas up: the summary's elapsed time); start-up (cluster, actors loading the model) is
printed apart. Driver overhead per record = the driver process's CPU time during the job / records
(reading, shipping blocks, writing results).

    python benchmarks/ray_scale.py [--records 48] [--max-tokens 24] [--batch-size 16] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

PROGRAM = '''import deepinfer as di


@di.function
def answer(s, text, n):
    s += "Q: " + text + "\\nA:"
    s += di.gen("answer", max_tokens=n, ignore_eos=True, temperature=0)
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    # the plain engine gets --cpus threads as each actor's does (Ray sets OMP_NUM_THREADS to an
    # actor's CPUs); an inherited OMP_NUM_THREADS=1 would leave OpenMP code on one thread
    os.environ["OMP_NUM_THREADS"] = str(args.cpus)

    import ray

    from deepinfer import Engine
    from deepinfer.jobs import JobOptions, load_program, run_job
    from deepinfer.jobs import ray as ray_jobs

    tmp = tempfile.mkdtemp(prefix="ray_scale_")
    prog_path = os.path.join(tmp, "bench_prog.py")
    with open(prog_path, "w") as f:
        f.write(PROGRAM)
    inp = os.path.join(tmp, "in.jsonl")
    with open(inp, "w") as f:
        for i in range(args.records):
            f.write(json.dumps({"id": i, "text": f"Tell me about the number {i}.", "n": args.max_tokens}) + "\n")

    def opts(name):
        return JobOptions(input=inp, output=os.path.join(tmp, name + ".jsonl"), batch_size=args.batch_size,
                          progress=False)

    def outputs(name):
        with open(os.path.join(tmp, name + ".jsonl")) as f:
            return sorted((json.loads(l)["id"], json.loads(l)["variables"]["answer"]) for l in f)

    print(f"ray_scale: {args.records} records x {args.max_tokens} tokens, batch size {args.batch_size}, "
          f"{args.cpus} CPUs, model {args.model or 'default'} (machine shared: figures taken under load)")
    rows = []
    t = time.monotonic()
    engine = Engine(args.model, num_threads=args.cpus)
    print(f"  plain: engine loaded in {time.monotonic() - t:.1f}s")

    def plain(name):  # run before and after the Ray runs: the machine's load drifts
        if os.path.exists(os.path.join(tmp, name + ".jsonl")):
            os.remove(os.path.join(tmp, name + ".jsonl"))
        engine.reset_prefix_cache()  # the second run must not reuse the first one's prompts
        c0 = time.process_time()
        s = run_job(load_program(prog_path + ":answer"), opts(name), engine)
        rows.append((name, s.processed / s.elapsed_s, (time.process_time() - c0) / s.processed, s.elapsed_s))

    # the engine's first job pays one-time costs (measured: 0.83-0.86 rec/s cold vs 1.4-2.3 warm
    # here); a short job on other records first. Ray's actors start cold: this favours plain.
    with open(os.path.join(tmp, "warm.jsonl"), "w") as f:
        for i in range(8):
            f.write(json.dumps({"id": i, "text": f"Warm up {i}", "n": args.max_tokens}) + "\n")
    run_job(load_program(prog_path + ":answer"), JobOptions(input=os.path.join(tmp, "warm.jsonl"),
            output=os.path.join(tmp, "warm-out.jsonl"), batch_size=args.batch_size, progress=False), engine)
    plain("plain")

    t = time.monotonic()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    print(f"  ray: local cluster up in {time.monotonic() - t:.1f}s")
    try:
        for replicas in (1, 2):
            cpus = args.cpus / replicas
            mark = {}
            t = time.monotonic()

            def ready(pool, mark=mark):
                mark["up"] = time.monotonic() - t
                mark["cpu"] = time.process_time()

            s = ray_jobs.run_job(prog_path + ":answer", opts(f"ray{replicas}"), args.model,
                                 {"num_threads": max(1, int(cpus))},
                                 ray_jobs.RayOptions(replicas=replicas, cpus_per_replica=cpus), on_ready=ready)
            driver_cpu = (time.process_time() - mark["cpu"]) / s.processed
            print(f"  ray {replicas} replica(s): actors up in {mark['up']:.1f}s")
            rows.append((f"ray x{replicas}", s.processed / s.elapsed_s, driver_cpu, s.elapsed_s))
    finally:
        ray.shutdown()
    plain("plain-after")
    same = outputs("plain") == outputs("ray1") == outputs("ray2") == outputs("plain-after")
    base = (rows[0][1] + rows[-1][1]) / 2
    print("  ratios against the mean of the two plain runs")
    for name, rate, cpu, el in rows:
        print(f"  {name:10s} {rate:7.2f} rec/s ({rate / base:4.2f}x plain)  job {el:6.1f}s  "
              f"driver CPU {1000 * cpu:6.2f} ms/record")
    print(f"  same records in all four runs: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
