"""One expert-parallel worker process: joins the group, loads the model with only its experts
(ep_model.shard_model as ModelRunner's model hook), then runs the commands the engine sends over its
pipe (a step's ForwardBatch, a KV copy, stats) until told to close or the engine goes away.

A thread stamps `heartbeats[rank]` twice a second, so the engine can tell a rank that is hung (a
stopped or wedged process: stale stamp) from one that merely waits in a collective for it."""

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


def worker_main(rank: int, world: int, rendezvous: str, config, model_source: str, device_name: str,
                dtype_name: str, threads: int, conn, heartbeats, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    threading.Thread(target=_heartbeat, args=(heartbeats, rank), daemon=True).start()
    import torch

    torch.set_num_threads(threads)
    try:
        from deepinfer.distributed.dispatch import CommStats
        from deepinfer.distributed.ep_model import shard_model
        from deepinfer.distributed.group import init_spawned, shutdown
        from deepinfer.distributed.wire import pack_tensor, unpack_batch
        from deepinfer.engine.loader import load_model
        from deepinfer.engine.model_runner import ModelRunner

        device = torch.device(device_name)
        info = init_spawned(rank, world, rendezvous, device, config.expert_parallel_timeout)
        device = info.device
        loaded = load_model(model_source, cache_dir=config.cache_dir)
        stats = CommStats()
        sharded = []
        runner = ModelRunner(config, loaded.config, loaded.weights, device, getattr(torch, dtype_name),
                             model_hook=lambda m: sharded.append(
                                 shard_model(m, rank, world, config.expert_parallel_dispatch, stats)))
        del loaded
        conn.send(("ok", dict(num_blocks=runner.num_blocks, kv_bytes_per_token=runner.kv_bytes_per_token,
                              weight_bytes=runner.weight_bytes(), precision=runner.precision,
                              moe_layers=sharded[0], pid=os.getpid())))
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
            op = msg[0]
            try:
                if op == "forward":
                    t0 = time.perf_counter()
                    logits = runner.forward(runner.prepare(unpack_batch(msg[1])))
                    stats.forward_s += time.perf_counter() - t0
                    conn.send(("ok", pack_tensor(logits) if rank == 0 else None))
                elif op == "copy_kv":
                    runner.copy_kv_tokens(*msg[1:])
                    conn.send(("ok", None))
                elif op == "stats":
                    conn.send(("ok", stats.as_dict()))
                    if msg[1]:
                        stats.reset()
                elif op == "close":
                    conn.send(("ok", None))
                    clean = True
                    break
                else:
                    conn.send(("error", f"unknown command {op!r}"))
            except Exception as e:  # noqa: BLE001 - a failed collective leaves the group unusable: report, exit
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
                break
    finally:
        if clean:
            shutdown()
        # skip the interpreter's teardown (1-2 s of torch finalisers here); after a failure the
        # group may be broken and tearing it down could wait on a dead peer
        os._exit(0 if clean else 1)
