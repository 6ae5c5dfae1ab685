"""What the two expert-parallel runners share (ep_runner.EpRunner starts its own workers;
group_runner.GroupRunner runs inside a launched process group): the ModelRunner interface over
several ranks (`RankRunners`), the configuration check made before any process starts or any group
is used, the per-rank KV budget, and the placeholder fill of a step's input ids. Both runner modules
import this one; it imports neither."""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.distributed.sharding import ExpertPlacement
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.errors import DistributedWorkerError, ExpertParallelConfigError

STARTUP_TIMEOUT_S = 600.0  # loading (and converting) a model can take minutes; a dead worker ends it at once
STALE_HEARTBEAT_S = 2.0


def check_ep_config(config, model_config) -> None:
    """What expert parallelism cannot run, refused before any process starts or any group is used."""
    N = config.expert_parallel_size
    moe = getattr(model_config, "moe", None)
    if moe is None:
        raise ExpertParallelConfigError(f"expert_parallel_size={N}: {model_config.architecture} has no routed experts")
    ExpertPlacement.initial(moe.num_experts, N, 0, config.expert_parallel_redundant)  # E % N, R % N: clear errors
    if config.expert_parallel_redundant and (config.kernels != "auto" or not config.cpu_prepack) \
            and not str(config.device).startswith("cuda"):
        raise ExpertParallelConfigError("expert_parallel_redundant needs the grouped expert kernel "
                                        "(kernels='auto' and cpu_prepack=True on CPU)")
    bad = [name for name, on in (("speculative", config.speculative is not None), ("cuda_graphs", config.cuda_graphs),
                                 ("quantized dtype", config.dtype.startswith("quantized"))) if on]
    if bad:
        raise ExpertParallelConfigError(f"expert_parallel_size={N} does not support {', '.join(bad)} yet")


def with_kv_budget(config, device: torch.device, N: int):
    """One KV budget per rank, decided by the engine process, so every rank sizes the same pool (the
    engine partitions block ids with one stride). On CPU the N pools share the machine's memory."""
    if config.kv_cache_memory is not None:
        return config
    from deepinfer.engine.model_runner import available_memory

    budget = int(available_memory(device) * config.kv_cache_fraction)
    if device.type == "cpu":
        budget = min(budget, config.max_kv_cache_memory_cpu) // N
    return dataclasses.replace(config, kv_cache_memory=max(budget, 1))


def resolve_placeholders(batch: ForwardBatch, prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """The batch's input ids with the overlapped loop's placeholders (-(r + 1): row r of the previous
    step's samples) filled in, on the CPU: what travels to the ranks."""
    ids = batch.input_ids
    if prev_tokens is None:
        return ids
    return torch.where(ids < 0, prev_tokens.cpu()[(-ids - 1).clamp(min=0, max=max(prev_tokens.numel() - 1, 0))], ids)


class RankRunners:
    """What the engine sees of a runner whose model lives on several ranks (EpRunner, GroupRunner):
    the ModelRunner interface; subclasses send the work."""

    info: list[dict]
    _forwards = 0

    def __init__(self, config, model_config, model_source: str, device: torch.device, dtype: torch.dtype, N: int):
        self.split = None  # the step cut per rank (attention data parallelism), once the pools' size is known
        self.kv_ranks = N  # one KV pool per rank (engine/kv_pools.py)
        self.config = config
        self.model_config = model_config
        self.model_source = model_source
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.world_size = N
        self.timeout = float(config.expert_parallel_timeout)
        self.failure: DistributedWorkerError | None = None
        self._rebalance_every = config.expert_parallel_rebalance_interval if config.expert_parallel_redundant else 0

    def weight_bytes(self) -> int:
        return sum(i["weight_bytes"] for i in self.info)

    def _pools_sized(self, infos: list[dict]) -> None:
        """Every rank sized the same KV pool: num_blocks usable blocks each (plus its scratch block)."""
        from deepinfer.distributed.dp_split import RankSplit

        if len({i["num_blocks"] for i in infos}) != 1:
            self.close()
            raise ExpertParallelConfigError(f"ranks sized different KV pools: {[i['num_blocks'] for i in infos]}")
        self.num_blocks = infos[0]["num_blocks"]
        self.split = RankSplit(self.world_size, self.num_blocks + 1)

    def _copy_msg(self, src_block: int, dst_block: int, n: int) -> tuple:
        """The KV copy command: run by the rank whose pool holds both blocks, in its local ids."""
        (r, src), (r2, dst) = self.split.local(src_block), self.split.local(dst_block)
        if r != r2:
            raise RuntimeError(f"KV copy between pools of rank {r} and rank {r2} (blocks {src_block} -> {dst_block})")
        return ("copy_kv", r, src, dst, n)

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        return batch  # each rank prepares its own attention metadata

    def measure_forward_cost(self, *a, **kw):
        raise ExpertParallelConfigError("expert parallelism does not measure forward costs (speculation is off)")

    def _begin_forward(self, batch: ForwardBatch, prev_tokens, num_layers):
        """The step cut into one sub-batch per rank (None: idle), the logits rows each rank's rows
        fill, and the step's capacity; every expert_parallel_rebalance_interval steps, first a
        re-placement of the redundant experts."""
        from deepinfer.distributed.dp_split import step_capacity

        if num_layers is not None:
            raise ExpertParallelConfigError("expert parallelism does not run early-exit (partial) forwards")
        self._forwards += 1
        if self._rebalance_every and self._forwards % self._rebalance_every == 0:
            self.rebalance_experts()
        subs, rows = self.split.split(dataclasses.replace(batch, input_ids=resolve_placeholders(batch, prev_tokens)))
        return subs, rows, step_capacity(subs)

    def _merge_logits(self, parts: list, rows: list[torch.Tensor]) -> torch.Tensor:
        """The whole step's logits from each rank's rows."""
        n = sum(int(r.numel()) for r in rows)
        out = torch.empty(n, self.model_config.vocab_size, dtype=torch.float32)
        for part, r in zip(parts, rows):
            if r.numel():
                out[r] = part[: r.numel()].to(out.dtype).cpu()
        return out.to(self.device)

    def rebalance_experts(self) -> dict:
        raise NotImplementedError
