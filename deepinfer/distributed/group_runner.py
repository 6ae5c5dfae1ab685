"""Expert parallelism inside a process group the user launched (torchrun): every rank runs the same
script, calls `deepinfer.distributed.init()` and builds `Engine(model, expert_parallel_size=N)` with N
the group's size. Rank 0 becomes the engine (scheduler, KV block pool, radix cache) and runs rank 0's
share of the model in its own process (`GroupRunner`); on every other rank the constructor serves
rank 0's steps (`serve`) until rank 0 closes its engine, then returns an engine that takes no
requests (`Engine.is_driver` is False there).

Commands travel through the group's key-value store (the TCPStore torchrun's env:// rendezvous
made), not through a collective: a rank waiting for the next step then waits on a key, which it may
do for as long as the user's script takes between calls, while the model's own collectives keep
the group's short timeout. Command k is the key `cmd/k` (a pickled ForwardBatch as numpy arrays,
wire.py); rank 0 deletes the keys every rank has read (all of them once a forward has returned:
a forward's collectives need every rank). Ranks stamp `hb/r` twice a second and leave `err/r` when
their own work fails, so rank 0 can name the rank behind a failed collective: the one that reported
an error, else the one whose heartbeat stopped (dead or stopped), else it says it cannot tell.
A rank also leaves when rank 0's heartbeat stops for longer than the group timeout (a crashed rank 0
under a launcher that does not clean up), so no rank waits forever.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
import weakref

import torch
import torch.distributed as dist

from deepinfer.distributed.dispatch import CommStats
from deepinfer.distributed.rank_runners import STALE_HEARTBEAT_S, STARTUP_TIMEOUT_S, RankRunners, with_kv_budget
from deepinfer.distributed.wire import pack_batch
from deepinfer.distributed.worker import HEARTBEAT_S, build_runner, execute
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.errors import DistributedWorkerError, ExpertParallelConfigError

PREFIX = "deepinfer/ep/"
POLL_S = 1.0  # a waiting rank re-checks rank 0's heartbeat this often
CLOSE_WAIT_S = 10.0  # rank 0's close waits this long for each rank to read it


class _Gone(Exception):
    pass


def _gone():
    raise _Gone


def _store() -> dist.Store:
    try:
        base = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as e:
        raise ExpertParallelConfigError(
            "expert parallelism in an existing process group needs the group's key-value store "
            f"(init_process_group with env:// or a store, as torchrun and deepinfer.distributed.init() do): {e}")
    return dist.PrefixStore(PREFIX, base)


def _beat(store: dist.Store, rank: int, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            store.set(f"hb/{rank}", repr(time.time()))
        except Exception:  # noqa: BLE001 - the store (rank 0's) is gone: nothing left to tell
            return
        stop.wait(HEARTBEAT_S)


def _start_heartbeat(store: dist.Store, rank: int) -> threading.Event:
    stop = threading.Event()
    store.set(f"hb/{rank}", repr(time.time()))
    threading.Thread(target=_beat, args=(store, rank, stop), daemon=True, name=f"deepinfer-hb-{rank}").start()
    return stop


def _age(store: dist.Store, rank: int) -> float:
    """Seconds since `rank` last stamped its heartbeat (0 before its first stamp: a rank still
    loading the checkpoint is not late; start-up has its own timeout)."""
    if not store.check([f"hb/{rank}"]):
        return 0.0
    return time.time() - float(store.get(f"hb/{rank}").decode())


def _wait_key(store: dist.Store, key: str, timeout: float, alive=None) -> bytes:
    """The value of `key` once set; `alive()` is asked every POLL_S and may raise to give up."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {key} within {timeout:g}s")
        try:
            store.wait([key], datetime.timedelta(seconds=min(POLL_S, left)))
            return store.get(key)
        except (RuntimeError, dist.DistStoreError) as e:
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise
        if alive is not None:
            alive()


class GroupRunner(RankRunners):
    """Rank 0's runner: the ModelRunner interface the engine uses, over the whole group."""

    def __init__(self, config, model_config, loaded, device: torch.device, dtype: torch.dtype):
        N = dist.get_world_size()
        super().__init__(config, model_config, loaded.source, device, dtype, N)
        config = with_kv_budget(config, device, N)
        self.store = _store()
        self._seq = [0]  # next command number (a list: shared with the finaliser)
        self._read = 0  # commands below this every rank has read (their keys are deleted)
        self._stop_beat = _start_heartbeat(self.store, 0)
        self._finalizer = weakref.finalize(self, GroupRunner._close_group, self.store, self._seq, self._stop_beat, N)
        dtype_name = str(dtype).removeprefix("torch.")
        self._put(("start", config, loaded.source, dtype_name))
        self.stats = CommStats()
        try:
            self.local, about = build_runner(config, loaded.source, device, dtype_name, 0, N, self.stats, loaded=loaded)
        except BaseException:
            self.close()
            raise
        infos = [about] + [self._reply(f"about/{r}", r, "start-up", STARTUP_TIMEOUT_S) for r in range(1, N)]
        self.info = infos
        self._pools_sized(infos)
        self.kv_bytes_per_token = self.local.kv_bytes_per_token
        self.bytes_per_block = self.block_size * self.kv_bytes_per_token
        self.precision = self.local.precision
        self.pids = [i["pid"] for i in infos]

    # ---- the ModelRunner interface the engine uses --------------------------------------------------
    def forward(self, batch: ForwardBatch, prev_tokens: torch.Tensor | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        subs, rows, cap = self._begin_forward(batch, prev_tokens, num_layers)
        most = max(int(r.numel()) for r in rows)
        packed = [pack_batch(sb) if sb is not None else None for sb in subs]
        self._put(("forward", packed, cap, most))
        try:
            mine = execute(self.local, self.stats, ("forward", packed[0], cap), want_logits=False)
            parts = _gather_logits(mine, most, self.world_size)
        except Exception as e:  # noqa: BLE001 - a collective failed: find the rank behind it
            self._blame(e, "a forward step")
        self._forget_read()
        return self._merge_logits(parts, rows)

    def copy_kv_tokens(self, src_block: int, dst_block: int, n: int) -> None:
        msg = self._copy_msg(src_block, dst_block, n)
        self._put(msg)
        execute(self.local, self.stats, msg, want_logits=False)

    def rebalance_experts(self) -> dict:
        """Re-place the redundant expert copies from the load measured since the last time (eplb.py)."""
        msg = ("rebalance", self.model_source, self.config.cache_dir)
        self._put(msg)
        try:
            return execute(self.local, self.stats, msg, want_logits=False)
        except Exception as e:  # noqa: BLE001 - its all_reduce failed: find the rank behind it
            self._blame(e, "an expert rebalance")

    def comm_stats(self, reset: bool = False) -> list[dict]:
        """Per rank: bytes sent and seconds in dispatch, combine, expert GEMMs, MoE layers, forwards."""
        k = self._put(("stats", reset))
        mine = execute(self.local, self.stats, ("stats", reset), want_logits=False)
        return [mine] + [self._reply(f"reply/{k}/{r}", r, "stats", self.timeout) for r in range(1, self.world_size)]

    def close(self) -> None:
        if self._finalizer.alive:
            if self.failure is not None:
                self._finalizer.detach()
                self._stop_beat.set()
            else:
                self._finalizer()

    @staticmethod
    def _close_group(store, seq, stop_beat, world: int) -> None:
        """Tell every rank to leave and wait (briefly) until each has read it: without a launcher's
        agent this process hosts the store, and leaving at once could cut a rank off mid-read."""
        try:
            store.set(f"cmd/{seq[0]}", pickle.dumps(("close",)))
            seq[0] += 1
            for r in range(1, world):
                try:
                    _wait_key(store, f"bye/{r}", CLOSE_WAIT_S, lambda r=r: _age(store, r) <= STALE_HEARTBEAT_S or _gone())
                except (TimeoutError, _Gone):
                    pass
        except Exception:  # noqa: BLE001 - the store is gone with the group: the ranks leave by themselves
            pass
        stop_beat.set()

    # ---- commands, replies and blame ---------------------------------------------------------------
    def _put(self, msg) -> int:
        if self.failure is not None:
            raise self.failure
        k = self._seq[0]
        self.store.set(f"cmd/{k}", pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self._seq[0] = k + 1
        return k

    def _forget_read(self) -> None:
        """After a forward every rank has read every command so far: delete their keys."""
        for k in range(self._read, self._seq[0]):
            self.store.delete_key(f"cmd/{k}")
        self._read = self._seq[0]

    def _reply(self, key: str, rank: int, what: str, timeout: float):
        def alive():
            self._check_rank(rank, what)

        try:
            status, payload = pickle.loads(_wait_key(self.store, key, timeout, alive))
        except TimeoutError:
            self._fail(rank, f"expert-parallel rank {rank} did not finish {what} within {timeout:g}s")
        self.store.delete_key(key)
        if status != "ok":
            self._fail(rank, f"expert-parallel rank {rank} failed during {what}: {payload}")
        return payload

    def _check_rank(self, rank: int, what: str) -> None:
        if self.store.check([f"err/{rank}"]):
            self._fail(rank, f"expert-parallel rank {rank} failed during {what}: {self.store.get(f'err/{rank}').decode()}")
        if _age(self.store, rank) > STALE_HEARTBEAT_S:  # (stamped once, then silent)
            self._fail(rank, f"expert-parallel rank {rank} stopped during {what} (no heartbeat for "
                             f"{STALE_HEARTBEAT_S:g}s: dead or hung)")

    def _blame(self, err: Exception, what: str):
        """A collective failed on rank 0: name the rank behind it (its report, else a stale heartbeat,
        waiting long enough for a killed rank's heartbeat to go stale)."""
        deadline = time.monotonic() + STALE_HEARTBEAT_S + 2 * HEARTBEAT_S
        while True:
            for r in range(1, self.world_size):
                self._check_rank(r, what)
            if time.monotonic() > deadline:
                break
            time.sleep(HEARTBEAT_S / 2)
        self._fail(None, f"the expert-parallel group failed during {what} and no rank reported why "
                         f"(every heartbeat is fresh): {type(err).__name__}: {err}")

    def _fail(self, rank: int | None, message: str):
        self.failure = DistributedWorkerError(message, rank=rank)
        self._stop_beat.set()
        self._finalizer.detach()
        raise self.failure


def _gather_logits(logits: torch.Tensor, most: int, world: int) -> list[torch.Tensor] | None:
    """Every rank's logits rows on rank 0 (padded to the step's most rows; None elsewhere)."""
    if most == 0:
        return [logits[:0]] * world if dist.get_rank() == 0 else None
    pad = logits.new_zeros(most, logits.shape[1])
    pad[: logits.shape[0]] = logits
    parts = [torch.empty_like(pad) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(pad, parts, dst=0)
    return parts


def serve(device: torch.device, loaded=None) -> None:
    """A torchrun rank other than 0: run rank 0's commands until it closes its engine (or stops
    beating for longer than the group timeout, or a command fails: then raise, naming this rank)."""
    rank = dist.get_rank()
    store = _store()
    stop_beat = _start_heartbeat(store, rank)
    runner = stats = None
    limit = None
    k = 0

    def driver_alive():
        if limit is not None and _age(store, 0) > limit:
            raise DistributedWorkerError(f"expert-parallel rank {rank}: rank 0 stopped beating for {limit:g}s; leaving",
                                         rank=0)

    try:
        while True:
            try:
                msg = pickle.loads(_wait_key(store, f"cmd/{k}", float("inf"), driver_alive))
            except (RuntimeError, dist.DistStoreError) as e:  # the store went with rank 0 (it hosts it
                # when no launcher agent does)
                raise DistributedWorkerError(f"expert-parallel rank {rank} lost the group's store (is rank 0 "
                                             f"gone?): {type(e).__name__}: {e}", rank=0) from e
            op = msg[0]
            if op == "close":
                store.set(f"bye/{rank}", b"1")
                return
            try:
                if op == "start":
                    config, source, dtype_name = msg[1:]
                    limit = max(float(config.expert_parallel_timeout), STALE_HEARTBEAT_S)
                    torch.set_num_threads(config.num_threads or torch.get_num_threads())
                    stats = CommStats()
                    mine = loaded if loaded is not None and loaded.source == source else None
                    loaded = None  # (dropped once the runner holds the weights)
                    runner, about = build_runner(config, source, device, dtype_name, rank, dist.get_world_size(), stats,
                                                 loaded=mine)
                    del mine
                    store.set(f"about/{rank}", pickle.dumps(("ok", about)))
                elif op == "forward":  # ("forward", every rank's sub-batch, capacity, most logits rows)
                    logits = execute(runner, stats, ("forward", msg[1][rank], msg[2]), want_logits=False)
                    _gather_logits(logits, msg[3], dist.get_world_size())
                elif op == "stats":
                    store.set(f"reply/{k}/{rank}", pickle.dumps(("ok", execute(runner, stats, msg, want_logits=False))))
                else:
                    execute(runner, stats, msg, want_logits=False)
            except Exception as e:  # noqa: BLE001 - told to rank 0 (which names this rank), then raised here
                report = f"{type(e).__name__}: {e}"
                store.set(f"err/{rank}", report)
                if op == "start":
                    store.set(f"about/{rank}", pickle.dumps(("error", report)))
                raise DistributedWorkerError(f"expert-parallel rank {rank} failed: {report}", rank=rank) from e
            k += 1
    finally:
        stop_beat.set()

