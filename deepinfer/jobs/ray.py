"""`deepinfer run --ray` / `run-batch --ray`: one job on a Ray cluster.

    from deepinfer.jobs import JobOptions
    from deepinfer.jobs.ray import RayOptions, run_job, run_batch_job

    run_job("prog.py:extract", JobOptions(input="in.jsonl", output="out.jsonl"),
            model=None, engine_options={}, ray_options=RayOptions(replicas=2))

Each replica is a Ray actor holding one `Engine` (`ray_worker.EngineWorker`); it runs blocks of
records through the same window as a local job (`window.run_window`). The driver reads the input
itself and hands blocks to actors (a plain driver-side reader, not Ray Data: see `RayPool`), and
writes every result through the same `stream.run_stream` as a local job (resume, progress,
exactly-once). A block whose actor dies is retried on a live actor; a key already written is never
written again, so each id appears once. Seeds derive from (seed, record id) as locally, so a record's
output does not depend on the replica that ran it.

Killing a job that started its own local cluster: signal its process group (what a terminal's
Ctrl-C or a batch scheduler does). A SIGKILL to the driver pid alone leaves that cluster's
DashboardAgent and RuntimeEnvAgent processes running (measured: still alive after 60 s).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from deepinfer.jobs.errors import JobUsageError
from deepinfer.jobs.records import Record
from deepinfer.jobs.runner import JobOptions
from deepinfer.jobs.stream import JobSummary
from deepinfer.jobs.window import Finished

INSTALL_HINT = "--ray needs Ray, which is not installed: pip install 'deepinfer[ray]' (or pip install ray)"


def require_ray() -> Any:
    """The ray module, or JobUsageError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise JobUsageError(INSTALL_HINT) from e
    return ray


@dataclass
class RayOptions:
    """Where and how wide: `address` None starts a local cluster (ray.init())."""

    address: str | None = None
    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    blocks_per_replica: int = 4  # blocks in flight per actor; a block is batch_size / this records
    max_block_retries: int = 3  # a block whose actor died this many times gets error records
    max_actor_restarts: int = 1  # Ray restarts a dead actor this often (reloading its engine)
    num_cpus: int | None = None  # local cluster only: CPUs it offers (None: all)

    def validate(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise JobUsageError(f"--replicas must be an int >= 1, got {self.replicas!r}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0:
            raise JobUsageError("--cpus-per-replica and --gpus-per-replica must be >= 0")
        if self.blocks_per_replica < 1 or self.max_block_retries < 0 or self.max_actor_restarts < 0:
            raise JobUsageError("blocks_per_replica must be >= 1, retries and restarts >= 0")


def _chunks(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    block: list[Record] = []
    for rec in records:
        block.append(rec)
        if len(block) >= size:
            yield block
            block = []
    if block:
        yield block


class RayPool:
    """Engine actors fed by the driver. Blocks are read from the input only when an actor has a
    free slot (the input is never read ahead of the pool's window); each block's results come
    back when it finishes and go straight to `on_finished` (so the output grows block by block).

    Ray Data's `map_batches` with an actor pool was the alternative; the driver needs each
    record's result back anyway (for the one writer with resume and exactly-once), which Ray
    Data would hand over through `iter_batches` after its own streaming executor; a plain
    reader keeps block retry on actor death in our hands and adds no executor start-up.
    """

    def __init__(self, kind: str, program: str | None, opts: JobOptions, model: str | None,
                 engine_options: dict[str, Any], ray_options: RayOptions, log: Callable[[str], None]) -> None:
        ray = require_ray()
        from deepinfer.jobs.ray_worker import worker_class

        self.ray, self.ray_options, self.log, self.kind = ray, ray_options, log, kind
        self.block_size = max(1, -(-opts.batch_size // ray_options.blocks_per_replica))
        window = self.block_size
        cls = worker_class(ray).options(
            num_cpus=ray_options.cpus_per_replica, num_gpus=ray_options.gpus_per_replica,
            max_concurrency=ray_options.blocks_per_replica, max_restarts=ray_options.max_actor_restarts,
            max_task_retries=0,  # the pool retries blocks itself, on any live actor
        )
        spec = {"kind": kind, "program": program, "opts": opts, "model": model,
                "engine_options": engine_options, "window": window}
        self.actors = [cls.remote(spec) for _ in range(ray_options.replicas)]
        self.alive = [True] * len(self.actors)
        self.per_actor = [0] * len(self.actors)
        self.retried_blocks = 0
        # fail fast (a bad model or program) before any block is handed out
        ray.get([a.ready.remote() for a in self.actors])

    def execute(self, records: Iterator[Record], on_finished: Callable[[Finished], None]) -> None:
        ray = self.ray
        blocks = _chunks(records, self.block_size)
        retry: deque[tuple[list[Record], int]] = deque()
        in_flight: dict[Any, tuple[int, list[Record], int]] = {}  # ref -> (actor, block, attempts)
        load = [0] * len(self.actors)
        exhausted = False
        while True:
            while True:  # fill every free slot of a live actor, retries first
                free = [i for i, a in enumerate(self.alive) if a and load[i] < self.ray_options.blocks_per_replica]
                if not free:
                    break
                if retry:
                    block, attempts = retry.popleft()
                elif not exhausted:
                    block = next(blocks, None)
                    if block is None:
                        exhausted = True
                        continue
                    attempts = 0
                else:
                    break
                i = min(free, key=lambda j: load[j])
                in_flight[self.actors[i].run_block.remote(block)] = (i, block, attempts)
                load[i] += 1
            if not in_flight:
                if retry:  # blocks left but no actor alive
                    self._fail_blocks(retry, "every Ray replica died", on_finished)
                return
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in ready:
                i, block, attempts = in_flight.pop(ref)
                load[i] -= 1
                try:
                    results = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # the actor died with this block in flight
                    self._actor_lost(i, e)
                    self.retried_blocks += 1
                    if attempts + 1 > self.ray_options.max_block_retries:
                        self._fail_blocks([(block, attempts + 1)], f"Ray actor died {attempts + 1} times", on_finished)
                    else:
                        retry.append((block, attempts + 1))
                    continue
                except ray.exceptions.RayTaskError as e:  # run_block itself raised: a bug, not the records'
                    self._fail_blocks([(block, attempts)], f"replica {i} failed the block: {e}", on_finished)
                    continue
                self.per_actor[i] += len(results)
                for f in results:
                    on_finished(f)

    def _actor_lost(self, i: int, err: BaseException) -> None:
        # a restartable actor comes back by itself (same handle); a dead one gets no more blocks
        try:
            self.ray.get(self.actors[i].ready.remote(), timeout=300)
            self.log(f"replica {i} restarted after: {type(err).__name__}")
        except Exception:
            self.alive[i] = False
            self.log(f"replica {i} is gone ({type(err).__name__}); {sum(self.alive)} left")

    def _fail_blocks(self, blocks: Any, why: str, on_finished: Callable[[Finished], None]) -> None:
        from deepinfer.jobs.ray_worker import error_results

        for block, _ in blocks:
            for f in error_results(self.kind, block, why):
                on_finished(f)

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:
                pass


def _log(msg: str) -> None:
    print(f"[deepinfer ray] {msg}", file=sys.stderr, flush=True)


def _run(kind: str, program: str | None, opts: JobOptions, model: str | None,
         engine_options: dict[str, Any] | None, ray_options: RayOptions | None,
         on_ready: Callable[[RayPool], None] | None = None) -> JobSummary:
    from deepinfer.jobs.batch_runner import run_batch_job as local_batch, validate_batch_options
    from deepinfer.jobs.program import load_program
    from deepinfer.jobs.runner import run_job as local_job, validate_options

    ray_options = ray_options or RayOptions()
    ray_options.validate()
    ray = require_ray()
    function = None
    if kind == "batch":
        validate_batch_options(opts)
    else:
        if not isinstance(program, str):
            raise JobUsageError("on Ray the program is given as 'FILE.py:FUNCTION' or 'MODULE:FUNCTION' "
                                "(each replica imports it)")
        function = load_program(program)
        validate_options(function, opts)  # before the cluster starts
    started_here = not ray.is_initialized()
    if started_here:
        t = time.monotonic()
        init: dict[str, Any] = {"address": ray_options.address, "log_to_driver": True,
                                "include_dashboard": False}
        if ray_options.address is None and ray_options.num_cpus is not None:
            init["num_cpus"] = ray_options.num_cpus
        ray.init(**init)
        _log(f"cluster up in {time.monotonic() - t:.1f}s: {ray.cluster_resources().get('CPU', 0):g} CPUs, "
             f"{ray.cluster_resources().get('GPU', 0):g} GPUs")
    pool = None
    try:
        t = time.monotonic()
        pool = RayPool(kind, program, opts, model, dict(engine_options or {}), ray_options, _log)
        _log(f"{ray_options.replicas} replica(s) ready in {time.monotonic() - t:.1f}s, blocks of {pool.block_size}")
        if on_ready is not None:
            on_ready(pool)
        if kind == "batch":
            summary = local_batch(opts, execute=pool.execute)
        else:
            summary = local_job(function, opts, None, execute=pool.execute)
        _log("records per replica: " + ", ".join(f"r{i} {n}" for i, n in enumerate(pool.per_actor))
             + f"; {pool.retried_blocks} block(s) retried")
        return summary
    finally:
        if pool is not None:
            pool.shutdown()
        if started_here:
            ray.shutdown()


def run_job(program: str, opts: JobOptions, model: str | None = None, engine_options: dict[str, Any] | None = None,
            ray_options: RayOptions | None = None, on_ready: Callable[[RayPool], None] | None = None) -> JobSummary:
    """`deepinfer run --ray`: `program` ('FILE.py:FUNCTION' or 'MODULE:FUNCTION') over `opts.input`
    on `ray_options.replicas` engine actors (each `Engine(model, **engine_options)`). Uses the
    running Ray session if there is one, else `ray.init(address)` (and shuts it down after).
    `on_ready(pool)` is called once the replicas are up (monitoring; the tests kill an actor)."""
    return _run("program", program, opts, model, engine_options, ray_options, on_ready)


def run_batch_job(opts: JobOptions, model: str | None = None, engine_options: dict[str, Any] | None = None,
                  ray_options: RayOptions | None = None, on_ready: Callable[[RayPool], None] | None = None
                  ) -> JobSummary:
    """`deepinfer run-batch --ray`: an OpenAI batch file on engine actors (see run_job)."""
    return _run("batch", None, opts, model, engine_options, ray_options, on_ready)
