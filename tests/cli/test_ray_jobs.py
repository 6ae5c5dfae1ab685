"""`deepinfer run --ray` on a local 2-CPU Ray cluster: same records as a local run, an actor
killed mid-job, the driver killed and resumed. Ray start-up and one engine per actor make this
slower than the CI budget allows, so it is marked slow (and ray is not in the `test` extra)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from deepinfer.jobs import JobOptions, load_program  # noqa: E402
from deepinfer.jobs import ray as ray_jobs  # noqa: E402
from deepinfer.jobs.runner import run_job  # noqa: E402

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROGS = os.path.join(HERE, "progs.py")
ENGINE = {"kv_cache_memory": 32 << 20, "batch_invariant": True, "seed": 5}


def write_records(path, n):
    path.write_text("".join(json.dumps({"id": f"k{i}", "text": f"question {i}"}) + "\n" for i in range(n)))


def results(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def by_id(lines):
    out = {}
    for r in lines:
        assert r["id"] not in out, f"id {r['id']} written twice"
        out[r["id"]] = r
    return out


def opts(tmp_path, out, **kw):
    base = dict(input=str(tmp_path / "in.jsonl"), output=str(out), progress=False, batch_size=8, seed=11,
                sampling={"temperature": 0.8})
    base.update(kw)
    return JobOptions(**base)


def _descendants(pid):
    """Pids of every live process below `pid` (from /proc; the ray processes the driver started)."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_driver_killed_then_resume(tmp_path, tiny_models):
    # first in the file: its driver starts its own local cluster, before the fixture's exists
    n = 60
    write_records(tmp_path / "in.jsonl", n)
    out = tmp_path / "o.jsonl"
    args = [f"{PROGS}:story", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--model", str(tiny_models["llama"]),
            "--kv-cache-memory", "32", "--batch-size", "4", "--seed", "3", "--temperature", "0.8",
            "--ray", "--replicas", "2", "--log-interval", "0.5"]
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer", "run", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    spawned = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            spawned = sorted(set(spawned) | set(_descendants(proc.pid)))
            if out.exists() and out.read_text().count("\n") >= 4:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job finished before the driver could be killed"
        # kill -9 the job as a terminal or a batch scheduler does: its whole process group. (A
        # SIGKILL to the driver pid alone leaves the local cluster's DashboardAgent and
        # RuntimeEnvAgent running, measured > 60 s: Ray's agents do not share the driver's fate.)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        # none of the local cluster's processes may outlive the job
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p) for p in spawned):
            time.sleep(0.5)
        left = [p for p in spawned if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for p in [p for p in spawned if _alive(p)]:  # only processes this test's driver started
            os.kill(p, signal.SIGKILL)
    assert not left, f"ray processes outlived the killed driver: {left}"
    n_before = out.read_text().count("\n")
    assert 4 <= n_before < n
    r = subprocess.run([sys.executable, "-m", "deepinfer", "run", *args, "--resume"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"{n_before} skipped" in r.stderr and "records per replica" in r.stderr
    got = by_id(results(out))
    assert sorted(got) == sorted(f"k{i}" for i in range(n))


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_replicas_write_the_same_records_as_a_local_run(tmp_path, tiny_models, cluster):
    from deepinfer import Engine

    write_records(tmp_path / "in.jsonl", 24)
    model = str(tiny_models["llama"])
    run_job(load_program(f"{PROGS}:echo"), opts(tmp_path, tmp_path / "local.jsonl"), Engine(model, **ENGINE))
    s = ray_jobs.run_job(f"{PROGS}:echo", opts(tmp_path, tmp_path / "ray.jsonl"), model, ENGINE,
                         ray_jobs.RayOptions(replicas=2))
    assert s.processed == 24 and s.failed == 0
    local, remote = by_id(results(tmp_path / "local.jsonl")), by_id(results(tmp_path / "ray.jsonl"))
    assert sorted(local) == sorted(remote) == sorted(f"k{i}" for i in range(24))
    assert local == remote  # per-record seeds: the replica that ran a record does not matter


def test_actor_killed_mid_job_each_id_once(tmp_path, tiny_models, cluster):
    n = 48
    write_records(tmp_path / "in.jsonl", n)
    out = tmp_path / "o.jsonl"
    pools = []

    def kill_when_running():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (pools and out.exists() and out.read_text().count("\n") >= 2):
            time.sleep(0.01)
        ray.kill(pools[0].actors[0], no_restart=True)  # gone for good: its blocks must go elsewhere

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    s = ray_jobs.run_job(f"{PROGS}:story", opts(tmp_path, out, batch_size=4), str(tiny_models["llama"]), ENGINE,
                         ray_jobs.RayOptions(replicas=2), on_ready=pools.append)
    killer.join()
    got = by_id(results(out))
    assert sorted(got) == sorted(f"k{i}" for i in range(n)) and s.processed == n
    assert all(r["ok"] for r in got.values())
    assert pools[0].retried_blocks >= 1 and not pools[0].alive[0]


def test_run_batch_on_two_replicas_equals_local(tmp_path, tiny_models, cluster):
    from deepinfer import Engine
    from deepinfer.jobs.batch_runner import run_batch_job

    from test_openai_batch import MIXED

    (tmp_path / "in.jsonl").write_text("\n".join(MIXED) + "\n")
    model = str(tiny_models["llama"])
    o = dict(progress=False, batch_size=4, seed=2)
    run_batch_job(JobOptions(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "local.jsonl"), **o),
                  Engine(model, **ENGINE), model=model)
    s = ray_jobs.run_batch_job(JobOptions(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "ray.jsonl"), **o),
                               model, ENGINE, ray_jobs.RayOptions(replicas=2))
    assert s.processed == len(MIXED)

    def norm(path):
        out = {}
        for line in results(path):
            if line["response"] and "created" in line["response"]["body"]:
                del line["response"]["body"]["created"]  # a timestamp
            out[line["id"]] = line
        return out

    local, remote = norm(tmp_path / "local.jsonl"), norm(tmp_path / "ray.jsonl")
    assert len(local) == len(MIXED) and local == remote
