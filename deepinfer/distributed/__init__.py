"""Expert parallelism across processes on torch.distributed (gloo on CPU, NCCL on CUDA).

group.py (process-group setup, torchrun's env vars, timeouts), sharding.py (which experts a rank
owns), dispatch.py (all-to-all dispatch / combine, normal and low-latency), ep_model.py (a worker's
model: its experts only, MoE token side data-parallel), worker.py (a worker process's loop) and
ep_runner.py (the engine-side stand-in for ModelRunner that drives the workers).
"""

from deepinfer.distributed.group import GroupInfo, init, shutdown
from deepinfer.distributed.sharding import ExpertShard, token_split

__all__ = ["ExpertShard", "GroupInfo", "init", "shutdown", "token_split"]
