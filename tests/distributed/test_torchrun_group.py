"""Expert parallelism inside a process group the user launched: torchrun (or its environment variables
set by hand) + deepinfer.distributed.init() + Engine(expert_parallel_size=world). Rank 0 is the engine;
the other ranks serve its steps and then refuse requests. Outputs equal the single-process engine's
bit for bit (batch-invariant mode); a killed rank is named in every request's error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import Engine
from moe_factory import make_moe_model

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
import group_script  # noqa: E402

SCRIPT = str(Path(__file__).parent / "group_script.py")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent)] + sys.path)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("group") / "deepseek_v3", "deepseek_v3", seed=3)


def test_torchrun_two_ranks_equal_single_process(model, tmp_path):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        SCRIPT, str(model), str(out), "generate"], env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    ref = group_script.runs(Engine(str(model), **group_script.KW))
    assert got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"]
    assert got["ranks"] == 2 and all(t > 0 for t in got["stats"])  # both ranks dispatched tokens
    worker = json.loads((tmp_path / "out.json.1").read_text())
    assert worker["rank"] == 1 and "takes no requests" in worker["refused"]


def _launch(model, out, mode: str) -> list[subprocess.Popen]:
    """The two ranks with torchrun's variables set by hand (no launcher agent to kill the rest)."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, SCRIPT, str(model), str(out), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def test_killed_rank_named_in_every_error(model, tmp_path):
    out = tmp_path / "out.json"
    procs = _launch(model, out, "kill")
    try:
        rc0 = procs[0].wait(timeout=600)
        err0 = procs[0].stderr.read()
        assert rc0 == 0, err0[-3000:]
        assert procs[1].wait(timeout=30) == -9  # (killed by rank 0's script)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = json.loads(out.read_text())
    assert res["elapsed"] < 20  # named well within the collective timeout, never a hang
    assert sorted(o[0] for o in res["outs"]) == sorted(res["ids"])
    for _, reason, error in res["outs"]:
        assert reason == "error" and "rank 1" in error, error


def test_rank_leaves_when_rank_0_dies(model, tmp_path):
    procs = _launch(model, tmp_path / "out.json", "die0")
    try:
        assert procs[0].wait(timeout=600) == -9
        assert procs[1].wait(timeout=60) != 0  # never waits forever for a dead rank 0
        err = procs[1].stderr.read()
        assert "DistributedWorkerError" in err and "rank 0" in err, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
