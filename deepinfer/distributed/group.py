"""Process-group setup for expert parallelism: gloo on CPU, NCCL on CUDA, collective timeouts always set.

`init()` joins the group a launcher describes with the usual torchrun variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `init_spawned()` is what the engine's own worker processes
call (a file rendezvous in a private temporary directory, so no TCP port can collide). A collective
that waits longer than the timeout raises in every rank that waits, which is how a dead or hung peer
becomes an error instead of a hang (gloo enforces it on CPU; NCCL needs its async error handling,
which recent torch turns on by default).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.errors import ExpertParallelConfigError

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GroupInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _timeout(seconds: float) -> datetime.timedelta:
    if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0):
        raise ExpertParallelConfigError(f"collective timeout must be a number of seconds > 0, got {seconds!r}")
    return datetime.timedelta(seconds=float(seconds))


def init(timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "auto") -> GroupInfo:
    """Join the process group described by torchrun's environment variables (idempotent)."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ExpertParallelConfigError(
            f"deepinfer.distributed.init(): {', '.join(missing)} not set; launch with torchrun "
            "(or let Engine(expert_parallel_size=N) start its own workers)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device == "auto":
        dev = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend_for(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=_timeout(timeout_s))
    return GroupInfo(rank, world, local, backend, dev)


def init_spawned(rank: int, world_size: int, rendezvous_file: str, device: torch.device,
                 timeout_s: float) -> GroupInfo:
    """Join the group of an engine's spawned workers (file rendezvous)."""
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = backend_for(device)
    dist.init_process_group(backend, init_method=f"file://{rendezvous_file}", rank=rank, world_size=world_size,
                            timeout=_timeout(timeout_s))
    return GroupInfo(rank, world_size, rank, backend, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
