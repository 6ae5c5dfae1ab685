"""The engine process's stand-in for ModelRunner under expert parallelism (make_ep_runner picks it, or
group_runner.py inside a launched group): starts N worker processes
(torch.multiprocessing, spawn), ships each step's ForwardBatch to all of them and returns rank 0's
logits. The engine's scheduler and its per-rank block pools and radix caches (engine/kv_pools.py)
stay in the engine process; each step is cut into one sub-batch per rank (dp_split.py: attention is
data-parallel, a sequence runs on the rank whose pool holds its KV, in that pool's local block ids)
and the ranks' logits rows are put back together in the step's order.

Faults: every reply is awaited together with every worker's process sentinel, up to
expert_parallel_timeout. A worker that exits ends the engine at once, named by rank; one that
stops answering is named at the timeout (its heartbeat is stale, while ranks blocked in a
collective waiting for it keep beating); an exception in a worker is raised with its message. Then
every worker is killed, and DistributedWorkerError reaches the engine, which finishes its requests
with reason "error". close() (or garbage collection, or interpreter exit) leaves no worker running.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from multiprocessing.connection import wait as mp_wait

import torch

from deepinfer.distributed.group_runner import GroupRunner, serve
from deepinfer.distributed.rank_runners import (STALE_HEARTBEAT_S, STARTUP_TIMEOUT_S, RankRunners, check_ep_config,
                                                with_kv_budget)
from deepinfer.distributed.wire import pack_batch, unpack_tensor
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.errors import DistributedWorkerError, ExpertParallelConfigError


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL: also ends a stopped (SIGSTOP) process
    for p in procs:
        p.join(timeout=5)


def weight_filter(config):
    """What the engine process itself reads of the checkpoint under expert parallelism: in a launched
    group, its rank's share (it runs that share); otherwise nothing but config and tokenizer (the
    spawned workers read their own shares)."""
    import torch.distributed as dist

    from deepinfer.distributed.sharding import expert_weight_filter, no_weights

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == config.expert_parallel_size:
        return expert_weight_filter(dist.get_rank(), dist.get_world_size(), config.expert_parallel_redundant)
    return no_weights


def make_ep_runner(config, model_config, loaded, device: torch.device, dtype: torch.dtype):
    """The runner of an expert-parallel engine: joins the process group this process is already in
    (torchrun + deepinfer.distributed.init(); group_runner.py), else starts its own workers. On a
    torchrun rank other than 0 it serves rank 0's steps until rank 0 closes, then returns None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world != config.expert_parallel_size:
            raise ExpertParallelConfigError(
                f"expert_parallel_size={config.expert_parallel_size}, but this process is rank {dist.get_rank()} "
                f"of a process group of {world}: launch {config.expert_parallel_size} processes "
                f"(torchrun --nproc_per_node) or set expert_parallel_size={world}")
        check_ep_config(config, model_config)
        if dist.get_rank() != 0:
            serve(device, loaded)
            return None
        return GroupRunner(config, model_config, loaded, device, dtype)
    return EpRunner(config, model_config, loaded.source, device, dtype)


class EpRunner(RankRunners):
    def __init__(self, config, model_config, model_source: str, device: torch.device, dtype: torch.dtype):
        N = config.expert_parallel_size
        check_ep_config(config, model_config)
        super().__init__(config, model_config, model_source, device, dtype, N)
        config = with_kv_budget(config, device, N)
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // N)
        ctx = torch.multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="deepinfer-ep-")
        self.heartbeats = ctx.Array("d", N, lock=False)
        self.procs, self.conns = [], []
        from deepinfer.distributed.worker import worker_main

        for r in range(N):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, daemon=True, name=f"deepinfer-ep-{r}",
                            args=(r, N, os.path.join(self._dir, "rendezvous"), config, model_source, str(device),
                                  str(dtype).removeprefix("torch."), threads, child, self.heartbeats, os.getpid()))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, EpRunner._cleanup, list(self.procs), self._dir)
        infos = self._collect("start-up", STARTUP_TIMEOUT_S)
        self.info = infos
        self._pools_sized(infos)
        self.kv_bytes_per_token = infos[0]["kv_bytes_per_token"]
        self.bytes_per_block = self.block_size * self.kv_bytes_per_token
        self.precision = infos[0]["precision"]
        self.pids = [i["pid"] for i in infos]

    # ---- the ModelRunner interface the engine uses --------------------------------------------------
    def forward(self, batch: ForwardBatch, prev_tokens: torch.Tensor | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        subs, rows, cap = self._begin_forward(batch, prev_tokens, num_layers)
        self._send_all([("forward", pack_batch(sb) if sb is not None else None, cap) for sb in subs])
        out = self._collect("a forward step", self.timeout)
        return self._merge_logits([unpack_tensor(o) for o in out], rows)

    def copy_kv_tokens(self, src_block: int, dst_block: int, n: int) -> None:
        self._send_all([self._copy_msg(src_block, dst_block, n)] * self.world_size)
        self._collect("a KV copy", self.timeout)

    def rebalance_experts(self) -> dict:
        """Re-place the redundant expert copies from the load measured since the last time (eplb.py)."""
        self._send_all([("rebalance", self.model_source, self.config.cache_dir)] * self.world_size)
        return self._collect("an expert rebalance", STARTUP_TIMEOUT_S)[0]

    def comm_stats(self, reset: bool = False) -> list[dict]:
        """Per rank: bytes sent and seconds in dispatch, combine, expert GEMMs, MoE layers, forwards."""
        self._send_all([("stats", reset)] * self.world_size)
        return self._collect("stats", self.timeout)

    def close(self) -> None:
        if self._finalizer.alive:
            if self.failure is None:
                try:
                    self._send_all([("close",)] * self.world_size)
                    self._collect("close", 10.0)
                except DistributedWorkerError:
                    pass
            self._finalizer()

    @staticmethod
    def _cleanup(procs, tmpdir) -> None:
        for p in procs:
            p.join(timeout=2)
        _kill_all(procs)
        shutil.rmtree(tmpdir, ignore_errors=True)

    # ---- messaging with fault detection ----------------------------------------------------------
    def _send_all(self, msgs) -> None:
        if self.failure is not None:
            raise self.failure
        for r, (c, m) in enumerate(zip(self.conns, msgs)):
            try:
                c.send(m)
            except (BrokenPipeError, OSError):
                self._died(r, "a send")  # the same error as a death seen while collecting

    def _collect(self, what: str, timeout: float) -> list:
        """Every rank's reply, or DistributedWorkerError naming the rank that died, hung or failed."""
        deadline = time.monotonic() + timeout
        replies: dict[int, object] = {}
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        while pending:
            watch = {}
            for r in pending:
                watch[self.conns[r]] = r
                watch[self.procs[r].sentinel] = r
            ready = mp_wait(list(watch), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                now = time.time()
                stale = sorted(r for r in pending if now - self.heartbeats[r] > STALE_HEARTBEAT_S)
                blame = stale or sorted(pending)
                self._fail(blame[0], f"expert-parallel worker rank {blame[0]} did not finish {what} within "
                                     f"{timeout:g}s ({'hung: no heartbeat' if stale else 'timed out'}; "
                                     f"rank(s) {sorted(pending)} silent)")
            # replies before exits: a worker that reported an error and exited is named by its report
            for obj in sorted(ready, key=lambda o: not hasattr(o, "recv")):
                r = watch[obj]
                if r not in pending:
                    continue
                conn = self.conns[r]
                if obj is conn or conn.poll():
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):
                        self._died(r, what)
                    pending.discard(r)
                    (replies if status == "ok" else errors)[r] = payload
                else:
                    self._died(r, what)
        if errors:
            # a rank whose own work failed, rather than one that saw its peer's failure in a collective
            peer = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
            own = [r for r in sorted(errors) if not any(s in errors[r].lower() for s in peer)]
            r = (own or sorted(errors))[0]
            self._fail(r, f"expert-parallel worker rank {r} failed during {what}: {errors[r]}")
        return [replies[r] for r in range(self.world_size)]

    def _died(self, r: int, what: str):
        self.procs[r].join(timeout=1)
        hint = (" (workers are spawned: a launching script must guard its top level with "
                "`if __name__ == '__main__':`)" if what == "start-up" else "")
        self._fail(r, f"expert-parallel worker rank {r} died during {what} (exit code {self.procs[r].exitcode}){hint}")

    def _fail(self, rank: int, message: str):
        self.failure = DistributedWorkerError(message, rank=rank)
        _kill_all(self.procs)
        self._finalizer()
        raise self.failure
