"""vLLM CPU as a peer in our benchmarks: found in the environment ../shared/peers/setup.sh builds
(DIR/vllm, DIR/vllm-env, the default model as an HF directory in DIR/smollm2-hf), run as one long-lived
worker process per dtype (`vllm_worker.py`), so its start-up (a minute or more here) is paid once and
its runs can alternate with ours. Prompts go over as token ids, so both sides see the same tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
# Two workers (bf16 and fp32) live next to our engine: vllm-env's 4 GiB of KV cache each would take a
# third of this 24 GiB host; the largest job here (128 sequences x ~90 tokens) needs well under 1 GiB.
KV_CACHE_GIB = 1
# vLLM's shared-memory queues keep busy-polling for 1 s after their last message (SpinCondition's
# busy_loop_s): the next arm timed after a vLLM run waits this long so it does not share the cores
SETTLE_S = 1.5


@dataclass
class PeerRun:
    seconds: float  # LLM.generate only
    texts: list[str]
    tokens: list[int]
    finish: list[str]


def find_vllm(peers_dir: str | None) -> tuple[tuple[str, str, str] | None, str]:
    """((python, env file, model dir), "") of the vLLM peer, or (None, why it is skipped)."""
    if not peers_dir:
        return None, "no --peers directory given (DEEPINFER_PEERS unset)"
    py = os.path.join(peers_dir, "vllm", "bin", "python")
    env = os.path.join(peers_dir, "vllm-env")
    model = os.path.join(peers_dir, "smollm2-hf")
    for path, what in ((py, "vllm"), (env, "vllm"), (os.path.join(model, "config.json"), "hf")):
        if not os.path.exists(path):
            return None, f"{path} not found (build with ../shared/peers/setup.sh {peers_dir} {what})"
    return (py, env, model), ""


class VllmPeer:
    """One vLLM `LLM` in its own process (started by the constructor; `wait_ready` blocks until loaded)."""

    def __init__(self, found: tuple[str, str, str], dtype: str, eager: bool = True, bind: str | None = None):
        py, env_file, model = found
        self.dtype = dtype
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"vllm-{dtype}-", suffix=".log", delete=False)
        env = f"VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}" + (f" VLLM_CPU_OMP_THREADS_BIND={bind}" if bind else "")
        cmd = ["bash", "-c", 'source "$1" && export $2 && shift 2 && exec "$@"', "_",
               env_file, env, py, WORKER, model, dtype, "1" if eager else "0"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            tail = open(self.log.name).read()[-3000:]
            raise RuntimeError(f"vLLM {self.dtype} worker exited (rc={self.proc.poll()}); log {self.log.name}:\n{tail}")
        return json.loads(line)

    def wait_ready(self) -> None:
        self._answer()

    def generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True,
                 json_schema: dict | None = None) -> PeerRun:
        req = {"prompts": prompts, "max_tokens": max_tokens, "ignore_eos": ignore_eos, "json_schema": json_schema}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        a = self._answer()
        time.sleep(SETTLE_S)
        return PeerRun(a["seconds"], a["texts"], a["tokens"], a["finish"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the worker's loop ends at EOF and vLLM shuts its processes down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def start_vllm(peers_dir: str | None, dtypes: list[str], eager: bool = True,
               bind: str | None = None) -> tuple[dict[str, VllmPeer], str]:
    """Workers for `dtypes`, started together and loaded ({} and why if the peer is absent)."""
    found, why = find_vllm(peers_dir)
    if found is None:
        return {}, why
    peers = {d: VllmPeer(found, d, eager, bind) for d in dtypes}
    try:
        for p in peers.values():
            p.wait_ready()
    except Exception:
        for p in peers.values():
            p.close()
        raise
    return peers, ""
