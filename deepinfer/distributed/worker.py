"""One expert-parallel rank's side: the model with only its experts (ep_model.shard_model as
ModelRunner's model hook) and the commands the engine sends it (a step's ForwardBatch, a KV copy,
stats, close). `build_runner` and `execute` are shared by the engine's spawned workers
(`worker_main`, commands over a pipe) and by a torchrun group's ranks (group_runner.py, commands
broadcast over the group).

A spawned worker's thread stamps `heartbeats[rank]` twice a second, so the engine can tell a rank
that is hung (a stopped or wedged process: stale stamp) from one that merely waits in a collective
for it."""

from __future__ import annotations

import os
import threading
import time
import traceback

HEARTBEAT_S = 0.5


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when the engine process dies, however it dies."""
    import signal

    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _heartbeat(heartbeats, rank: int) -> None:
    while True:
        heartbeats[rank] = time.time()
        time.sleep(HEARTBEAT_S)


def build_runner(config, model_source: str, device, dtype_name: str, rank: int, world: int, stats, loaded=None):
    """This rank's ModelRunner (its experts only) and what the engine needs to know about it; `loaded`:
    the checkpoint when this process has it already (a torchrun group's rank 0)."""
    import torch

    from deepinfer.distributed.ep_model import shard_model
    from deepinfer.distributed.sharding import expert_weight_filter
    from deepinfer.engine.loader import load_model
    from deepinfer.engine.model_runner import ModelRunner

    if loaded is None:  # this rank's experts only
        loaded = load_model(model_source, cache_dir=config.cache_dir,
                            tensor_filter=expert_weight_filter(rank, world, config.expert_parallel_redundant))
    sharded = []
    runner = ModelRunner(config, loaded.config, loaded.weights, device, getattr(torch, dtype_name),
                         model_hook=lambda m: sharded.append(
                             shard_model(m, rank, world, config.expert_parallel_dispatch, stats,
                                         redundant=config.expert_parallel_redundant)))
    del loaded
    # the pool's last block is this rank's scratch block (dp_split.scratch_batch), never the engine's
    runner.ep_scratch_block = runner.num_blocks - 1
    runner.ep_rank = rank
    return runner, dict(num_blocks=runner.num_blocks - 1, kv_bytes_per_token=runner.kv_bytes_per_token,
                        weight_bytes=runner.weight_bytes(), precision=runner.precision,
                        moe_layers=sharded[0], pid=os.getpid())


def execute(runner, stats, msg, want_logits: bool):
    """Run one command; returns its reply payload (logits only when want_logits)."""
    from deepinfer.distributed.wire import pack_tensor, unpack_batch

    op = msg[0]
    if op == "forward":  # ("forward", this rank's sub-batch or None (idle), the step's capacity)
        from deepinfer.distributed.dp_split import scratch_batch
        from deepinfer.distributed.ep_model import set_step_capacity

        t0 = time.perf_counter()
        batch = unpack_batch(msg[1]) if msg[1] is not None else scratch_batch(runner.ep_scratch_block, runner.block_size)
        set_step_capacity(runner.model, msg[2])
        logits = runner.forward(runner.prepare(batch))
        stats.forward_s += time.perf_counter() - t0
        return pack_tensor(logits) if want_logits else logits
    if op == "copy_kv":  # ("copy_kv", the rank whose pool holds both blocks, local src, local dst, tokens)
        if msg[1] == runner.ep_rank:
            runner.copy_kv_tokens(*msg[2:])
        return None
    if op == "rebalance":
        from deepinfer.distributed.eplb import rebalance

        return rebalance(runner.model, msg[1], msg[2])
    if op == "stats":
        out = stats.as_dict()
        if msg[1]:
            stats.reset()
        return out
    raise ValueError(f"unknown command {op!r}")


def worker_main(rank: int, world: int, rendezvous: str, config, model_source: str, device_name: str,
                dtype_name: str, threads: int, conn, heartbeats, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    threading.Thread(target=_heartbeat, args=(heartbeats, rank), daemon=True).start()
    import torch

    torch.set_num_threads(threads)
    try:
        from deepinfer.distributed.dispatch import CommStats
        from deepinfer.distributed.group import init_spawned, shutdown

        info = init_spawned(rank, world, rendezvous, torch.device(device_name), config.expert_parallel_timeout)
        stats = CommStats()
        runner, about = build_runner(config, model_source, info.device, dtype_name, rank, world, stats)
        conn.send(("ok", about))
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises it typed
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    clean = False
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the engine is gone
                break
            if msg[0] == "close":
                conn.send(("ok", None))
                clean = True
                break
            try:
                conn.send(("ok", execute(runner, stats, msg, want_logits=True)))
            except Exception as e:  # noqa: BLE001 - a failed collective leaves the group unusable: report, exit
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
                break
    finally:
        if clean:
            shutdown()
        # skip the interpreter's teardown (1-2 s of torch finalisers here); after a failure the
        # group may be broken and tearing it down could wait on a dead peer
        os._exit(0 if clean else 1)
