"""`deepinfer run --ray` / `run-batch --ray`: one job as a Ray Data pipeline.

    from deepinfer.jobs import JobOptions
    from deepinfer.jobs.ray import RayOptions, run_job
    run_job("prog.py:extract", JobOptions(input="in/*.jsonl", output="out/"), model=None,
            engine_options={}, ray_options=RayOptions(replicas=2))

read (`ray_io.read_input`: JSON lines with their line numbers, or Parquet; in the workers)
-> `map_batches` with the engine stage (`deepinfer.ray.map_batches_kwargs`: one Engine per actor,
the local job's parsing, seeds and output lines) -> `ray_io.ShardSink` (sharded JSON-lines result
files in the output folder, next to `manifest.json`).

The pipeline runs in one coordinator task on the cluster (num_cpus=0), not in this process: the
driver holds no record and imports no Ray Data (pyarrow and pandas: +120 MB, measured) so its memory
stays flat as the input grows; it only waits, and tails the shards for the progress line.

- Resume (`--resume`): the coordinator scans the shards (cutting a half-written last line) and the
  stage drops every row whose key is there, so a record is never written twice.
- Faults: an actor that dies mid-batch is restarted by Ray and its batch retried (Ray Data's actor
  pool defaults: max_restarts=-1, max_task_retries=-1); the batch's rows only reach the writer when
  the batch has finished, and a retried write task rewrites its own shard, so nothing is lost or
  written twice. A driver killed with kill -9 takes its local cluster with it (`ray_cluster`).
- Usage errors (bad input path, output folder of another job, ...) are raised before the cluster
  starts where they can be, otherwise from the coordinator before any model loads.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from deepinfer.jobs import ray_io
from deepinfer.jobs.errors import JobUsageError
from deepinfer.jobs.runner import JobOptions, check_batch_options
from deepinfer.jobs.stream import JobSummary
from deepinfer.ray import require_ray

__all__ = ["RayOptions", "require_ray", "run_job", "run_batch_job", "validate_ray_job"]


@dataclass
class RayOptions:
    """Where and how wide: `address` None starts a local cluster (in its own process group)."""

    address: str | None = None
    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    num_cpus: float | None = None  # local cluster only: CPUs it offers (None: the replicas' share, at least 1)
    max_restarts: int = -1  # per actor (Ray Data's default); max_task_retries follows Ray Data's (-1)

    def validate(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise JobUsageError(f"--replicas must be an int >= 1, got {self.replicas!r}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise JobUsageError("--cpus-per-replica and --gpus-per-replica must be >= 0")
        if self.num_cpus is not None and self.num_cpus < self.replicas * self.cpus_per_replica:
            raise JobUsageError(f"a local cluster of {self.num_cpus:g} CPUs cannot hold {self.replicas} replicas "
                                f"of {self.cpus_per_replica:g} CPUs")


def _log(msg: str) -> None:
    print(f"[deepinfer ray] {msg}", file=sys.stderr, flush=True)


def _key_of(kind: str) -> Callable[[dict[str, Any]], str]:
    if kind == "batch":
        from deepinfer.jobs.openai_format import line_key

        return line_key
    from deepinfer.jobs.output import result_key

    return result_key


def _manifest(kind: str, program: str | None, files: list[str], fmt: str, opts: JobOptions,
              model: str | None) -> dict[str, Any]:
    return {"format": "deepinfer-ray-job/1", "kind": kind, "program": program, "inputs": files,
            "input_format": fmt, "model": model, "seed": opts.seed, "sampling": opts.sampling,
            "mapping": opts.mapping, "field": opts.field, "limit": opts.limit}


def validate_ray_job(kind: str, program: str | None, opts: JobOptions, model: str | None = None
                     ) -> tuple[list[str], str, dict[str, Any]]:
    """Every check that needs neither the cluster nor the model; returns (input files, their
    format, the manifest this job writes). Raises JobUsageError naming the problem."""
    files = ray_io.expand_inputs(opts.input)
    fmt = ray_io.input_format(files)
    if kind == "batch" and fmt != "jsonl":
        raise JobUsageError("an OpenAI batch input is JSON lines, not Parquet")
    out = opts.output
    if os.path.exists(out) and not os.path.isdir(out):
        raise JobUsageError(f"with --ray the output is a folder of result shards; {out!r} is a file")
    if os.path.abspath(out) in {os.path.dirname(f) for f in files}:
        raise JobUsageError(f"the output folder {out!r} holds input files; pick another one")
    if opts.ordered:
        raise JobUsageError("--ordered is not supported with --ray (shards are written as batches finish)")
    check_batch_options(opts)
    manifest = _manifest(kind, program, files, fmt, opts, model)
    if os.path.isdir(out):
        old = ray_io.read_manifest(out)
        if ray_io.shards(out) and not opts.resume:
            raise JobUsageError(f"output folder {out!r} already has results; pass --resume to continue it, "
                                "or remove it")
        if old is not None and opts.resume:
            for k, v in manifest.items():
                if old.get(k) != v:
                    raise JobUsageError(f"--resume: {out!r} holds another job's results ({k} was {old.get(k)!r}, "
                                        f"now {v!r})")
    else:
        try:
            os.makedirs(out)
        except OSError as e:
            raise JobUsageError(f"cannot create the output folder {out!r}: {e.strerror or e}") from e
    if not os.access(out, os.W_OK):
        raise JobUsageError(f"cannot write to the output folder {out!r}")
    if kind == "program":
        _check_program(program, opts, files, fmt)
    return files, fmt, manifest


def _check_program(program: str | None, opts: JobOptions, files: list[str], fmt: str) -> None:
    """The local job's program checks (mapping; the compiler's checks traced on the first line)."""
    from dataclasses import replace

    from deepinfer.jobs.program import load_program, program_signature
    from deepinfer.jobs.records import check_mapping
    from deepinfer.jobs.runner import check_program

    if not isinstance(program, str):
        raise JobUsageError("on Ray the program is given as 'FILE.py:FUNCTION' or 'MODULE:FUNCTION'")
    function = load_program(program)
    check_mapping(program_signature(function), opts.mapping, opts.field)
    if fmt == "jsonl":
        check_program(function, replace(opts, input=files[0]))


def _coordinate(spec: Any, ray_args: dict[str, Any], kind: str, files: list[str], fmt: str, folder: str,
                run: str, resume: bool, limit: int | None) -> dict[str, Any]:
    """The pipeline, run as a task on the cluster (see the module docstring)."""
    import ray

    from deepinfer.jobs.records import check_unique_ids
    from deepinfer.ray import map_batches_kwargs

    if fmt == "jsonl":  # ids are unique per file (keys: the coordinator's memory, not the driver's)
        for f in files:
            check_unique_ids(f, None, "custom_id" if kind == "batch" else "id")
    done, cut = ray_io.scan_shards(folder, _key_of(kind)) if resume else (set(), 0)
    if done:
        spec.done = ray.put(sorted(done))
    n_done = len(done)
    del done
    ds = ray_io.read_input(files, fmt)
    if limit is not None:
        ds = ds.limit(limit)
    sink = ray_io.shard_sink(folder, run)
    ds.map_batches(**map_batches_kwargs(spec, ray_args)).write_datasink(sink, ray_remote_args={"num_cpus": 0})
    return {**sink.totals, "skipped": n_done, "truncated": cut}


class _ShardTail:
    """Counts the lines of this run's shards as they grow (the progress line; O(shards) memory)."""

    def __init__(self, folder: str, run: str, ok_of: Callable[[dict[str, Any]], bool]) -> None:
        self.folder, self.run, self.ok_of = folder, run, ok_of
        self.offsets: dict[str, int] = {}

    def poll(self, on_line: Callable[[bool], None]) -> None:
        for path in ray_io.shards(self.folder):
            if f"part-{self.run}-" not in os.path.basename(path):
                continue
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    if f.seek(0, os.SEEK_END) < start:  # a retried write task restarted its shard
                        start = 0
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            for raw in data[:end].splitlines():
                try:
                    on_line(self.ok_of(json.loads(raw)))
                except ValueError:
                    on_line(False)
            self.offsets[path] = start + end


def _count_input(files: list[str], fmt: str, limit: int | None) -> int | None:
    from deepinfer.jobs.records import count_records

    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            return None
        n = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    else:
        n = sum(count_records(f) for f in files)
    return min(n, limit) if limit is not None else n


def _count_lines(paths: list[str]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            for raw in f:
                n += raw.endswith(b"\n")
    return n


def _run(kind: str, program: str | None, opts: JobOptions, model: str | None,
         engine_options: dict[str, Any] | None, ray_options: RayOptions | None) -> JobSummary:
    from deepinfer.jobs.progress import Progress
    from deepinfer.jobs.ray_cluster import ClusterStartError, start_local
    from deepinfer.jobs.ray_worker import StageSpec
    from deepinfer.ray import _payload, map_batches_kwargs

    ray_options = ray_options or RayOptions()
    ray_options.validate()
    ray = require_ray()
    files, fmt, manifest = validate_ray_job(kind, program, opts, model)
    engine_options = dict(engine_options or {})
    # Engine's default uses every core; an actor gets its reserved CPUs' worth of threads
    engine_options.setdefault("num_threads", max(1, int(ray_options.cpus_per_replica)))
    payload = None
    if kind == "program":
        from deepinfer.jobs.program import load_program

        payload = _payload(load_program(program))
    spec = StageSpec(kind=kind, payload=payload, model=model, engine_options=engine_options, seed=opts.seed,
                     sampling=dict(opts.sampling), mapping=dict(opts.mapping), field_name=opts.field,
                     window=opts.batch_size, rows="lines", out="lines", multi_input=len(files) > 1)
    ray_args = {"concurrency": ray_options.replicas, "batch_size": opts.batch_size,
                "num_cpus": ray_options.cpus_per_replica, "max_restarts": ray_options.max_restarts}
    if ray_options.gpus_per_replica:
        ray_args["num_gpus"] = ray_options.gpus_per_replica
    map_batches_kwargs(spec, ray_args)  # its argument checks, before the cluster starts

    cluster = None
    started_here = not ray.is_initialized()
    t = time.monotonic()
    if started_here:
        address = ray_options.address
        if address is None:
            cpus = ray_options.num_cpus or max(1.0, ray_options.replicas * ray_options.cpus_per_replica)
            cluster = start_local(cpus)
            address = cluster.address
            _log(f"local cluster at {address}, process group {cluster.pgid} (ends with this process)")
    try:
        if started_here:
            deadline = time.monotonic() + 120
            while True:  # the head's port opens before its raylet registers
                try:
                    ray.init(address=address, log_to_driver=False)
                    break
                except (ConnectionError, RuntimeError) as e:
                    if isinstance(e.__cause__, ray.exceptions.AuthenticationError):
                        raise ClusterStartError(f"cannot attach to the Ray cluster at {address}: {e.__cause__}") from e
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)
            res = ray.cluster_resources()
            _log(f"cluster up in {time.monotonic() - t:.1f}s: {res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs")
        run = time.strftime("%Y%m%d%H%M%S") + "-" + uuid.uuid4().hex[:6]
        old = ray_io.read_manifest(opts.output) or {}
        runs = list(old.get("runs", [])) + [{"run": run, "started": time.time()}]
        ray_io.write_manifest(opts.output, {**manifest, "runs": runs})
        already = _count_lines(ray_io.shards(opts.output)) if opts.resume else 0
        progress = Progress(_count_input(files, fmt, opts.limit), already_done=already,
                            log_interval=opts.log_interval, enabled=opts.progress, use_bar=opts.progress_bar)
        ok_of = (lambda d: d.get("error") is None) if kind == "batch" else (lambda d: bool(d.get("ok")))
        tail = _ShardTail(opts.output, run, ok_of)
        coordinate = ray.remote(num_cpus=0, max_retries=0)(_coordinate)
        ref = coordinate.remote(spec, ray_args, kind, files, fmt, opts.output, run, opts.resume, opts.limit)
        try:
            while not ray.wait([ref], timeout=min(max(opts.log_interval, 0.2), 2.0))[0]:
                tail.poll(lambda ok: progress.update(ok, 0))
            try:
                totals = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, JobUsageError):
                    raise e.cause from None
                raise
            tail.poll(lambda ok: progress.update(ok, 0))
        finally:
            progress.close()
        if totals["truncated"]:
            _log(f"removed a half-written last line ({totals['truncated']} bytes); its record was redone")
        summary = JobSummary(processed=totals["written"], failed=totals["failed"], skipped=totals["skipped"],
                             tokens=totals["tokens"], elapsed_s=progress.elapsed(),
                             truncated_bytes=totals["truncated"])
        runs[-1].update(finished=time.time(), written=summary.processed, failed=summary.failed,
                        skipped=summary.skipped)
        ray_io.write_manifest(opts.output, {**manifest, "runs": runs})
        _log(f"{summary.processed} records in {len(ray_io.shards(opts.output))} shard(s) under {opts.output}")
        return summary
    finally:
        if started_here:
            ray.shutdown()
        if cluster is not None:
            cluster.stop()


def run_job(program: str, opts: JobOptions, model: str | None = None, engine_options: dict[str, Any] | None = None,
            ray_options: RayOptions | None = None) -> JobSummary:
    """`deepinfer run --ray`: `program` ('FILE.py:FUNCTION' or 'MODULE:FUNCTION') over `opts.input`
    (a JSON-lines or Parquet path, glob or folder) into the folder `opts.output`, on
    `ray_options.replicas` engine actors (each `Engine(model, **engine_options)`). Uses the running
    Ray session if there is one, else `ray_options.address`, else a local cluster of its own."""
    return _run("program", program, opts, model, engine_options, ray_options)


def run_batch_job(opts: JobOptions, model: str | None = None, engine_options: dict[str, Any] | None = None,
                  ray_options: RayOptions | None = None) -> JobSummary:
    """`deepinfer run-batch --ray`: an OpenAI batch file on engine actors (see run_job)."""
    return _run("batch", None, opts, model, engine_options, ray_options)
