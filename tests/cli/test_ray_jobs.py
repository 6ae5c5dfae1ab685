"""`deepinfer run --ray` and `deepinfer.ray.processor` on a local 2-CPU Ray cluster (tiny model).
Ray start-up and one engine per actor take tens of seconds, so these are marked slow."""

import glob
import json
import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROGS = os.path.join(HERE, "progs.py")


def write_records(path, n):
    path.write_text("".join(json.dumps({"id": f"k{i}", "text": f"question {i}"}) + "\n" for i in range(n)))


def by_id(paths):
    out = {}
    for p in paths:
        for line in open(p):
            r = json.loads(line)
            assert r["id"] not in out, f"id {r['id']} written twice"
            out[r["id"]] = r
    return out


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "deepinfer", "run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_run_ray_two_replicas_writes_what_a_local_run_writes(tmp_path, tiny_models):
    write_records(tmp_path / "in.jsonl", 24)
    common = [f"{PROGS}:echo", "-i", str(tmp_path / "in.jsonl"), "--model", str(tiny_models["llama"]),
              "--kv-cache-memory", "32", "--batch-size", "4", "--seed", "3", "--temperature", "0.8", "-q"]
    local = cli(*common, "-o", str(tmp_path / "local.jsonl"))
    assert local.returncode == 0, local.stderr
    r = cli(*common, "-o", str(tmp_path / "ray"), "--ray", "--replicas", "2")
    assert r.returncode == 0, r.stderr
    shards = glob.glob(str(tmp_path / "ray" / "part-*.jsonl"))
    assert shards and os.path.exists(tmp_path / "ray" / "manifest.json")
    want, got = by_id([tmp_path / "local.jsonl"]), by_id(shards)
    assert sorted(got) == sorted(f"k{i}" for i in range(24))
    assert {k: v["variables"] for k, v in got.items()} == {k: v["variables"] for k, v in want.items()}
    # a second run over the same folder without --resume is refused before any cluster starts
    again = cli(*common, "-o", str(tmp_path / "ray"), "--ray")
    assert again.returncode != 0 and "--resume" in again.stderr


def test_processor_in_a_user_pipeline(tmp_path, tiny_models):
    import ray.data

    import deepinfer.ray
    from deepinfer.jobs import load_program

    rows = [{"id": f"k{i}", "text": f"question {i}"} for i in range(10)] + [{"id": "bad", "text": None}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    echo = load_program(f"{PROGS}:echo")
    stage = deepinfer.ray.processor(echo, str(tiny_models["llama"]), {"kv_cache_memory": 32 << 20, "num_threads": 1},
                                    seed=3, concurrency=1, batch_size=4, num_cpus=1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # not a stale cluster file
    try:
        out = ray.data.read_json(str(tmp_path / "in.jsonl")).map_batches(**stage).take_all()
    finally:
        ray.shutdown()
    got = {r["id"]: r for r in out}
    assert sorted(got) == sorted(r["id"] for r in rows)  # the bad row is a row too, not a failed batch
    for i in range(10):
        r = got[f"k{i}"]
        assert r["error"] is None and isinstance(r["answer"], str) and r["tag"] == "x"
    assert got["bad"]["error"] and "text" in got["bad"]["error"]


GATED = '''
import os
import time

import deepinfer as di

GATE = {gate!r}


@di.function
def gated(s, text):
    if text.startswith("wait"):  # these records cannot finish before the test opens the gate
        while not os.path.exists(GATE):
            time.sleep(0.05)
    s += "Q: " + text + "\\nA:"
    s += di.gen("answer", max_tokens=4)
'''


def _stat(pid):
    """(pgid, sid) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[2]), int(fields[3]))


def _job_processes(group, token):
    """Live processes in the cluster's process group or session, or with the job's auth token."""
    found = {}  # pid: argv[0]
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        st = _stat(int(d))
        if st is None:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            env = []
        if group in st or token in env:
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    found[int(d)] = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                found[int(d)] = ""
    return found


def _wait_for(cond, timeout, what):
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def test_driver_killed_mid_job_leaves_no_process_and_resume_writes_each_id_once(tmp_path, tiny_models):
    import signal

    gate = tmp_path / "gate"
    (tmp_path / "gated.py").write_text(GATED.format(gate=str(gate)))
    ids = [f"k{i}" for i in range(24)]
    # the last block of rows waits on the gate: the job is mid-way when the driver is killed
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"id": k, "text": ("wait " if i >= 18 else "") + f"question {i}"}) + "\n"
        for i, k in enumerate(ids)))
    out = tmp_path / "ray"
    args = [f"{tmp_path / 'gated.py'}:gated", "-i", str(tmp_path / "in.jsonl"), "--model", str(tiny_models["llama"]),
            "--kv-cache-memory", "32", "--batch-size", "4", "--seed", "3", "-q", "-o", str(out), "--ray",
            "--replicas", "2"]
    err = open(tmp_path / "driver.err", "w+")
    driver = subprocess.Popen([sys.executable, "-m", "deepinfer", "run", *args], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=err)
    group = token = None
    try:
        def cluster_logged():
            assert driver.poll() is None, open(tmp_path / "driver.err").read()
            return "process group" in open(tmp_path / "driver.err").read()

        _wait_for(cluster_logged, 180, "the local cluster")
        group = int(open(tmp_path / "driver.err").read().split("process group ")[1].split()[0])
        with open(f"/proc/{group}/environ", "rb") as f:  # the watchdog's: the job's own auth token
            token = next(e for e in f.read().split(b"\0") if e.startswith(b"RAY_AUTH_TOKEN="))

        def some_written():
            assert driver.poll() is None, open(tmp_path / "driver.err").read()
            return any(line.endswith("\n") for p in glob.glob(str(out / "part-*.jsonl")) for line in open(p))

        _wait_for(some_written, 240, "the first result lines")
        before = _job_processes(group, token)
        assert group in before  # the watchdog
        assert any("raylet" in c for c in before.values()), before  # the head's daemons
        assert any("MapWorker" in c for c in before.values()), before  # the engine actors
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        _wait_for(lambda: not _job_processes(group, token), 60, "the job's processes to end")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in _job_processes(group, token) if group else []:  # never leak a cluster, even on failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    written = {}
    for p in glob.glob(str(out / "part-*.jsonl")):
        for line in open(p):
            if line.endswith("\n"):
                written[json.loads(line)["id"]] = p
    assert written and not set(written) & {f"k{i}" for i in range(18, 24)}  # only the ungated rows finished
    gate.write_text("")
    again = cli(*args, "--resume")
    assert again.returncode == 0, again.stderr
    got = by_id(glob.glob(str(out / "part-*.jsonl")))  # fails on any id written twice
    assert sorted(got) == sorted(ids)
    assert all(r["ok"] for r in got.values())
    for k, p in written.items():  # what the killed run wrote is kept, not redone
        assert any(json.loads(line)["id"] == k for line in open(p))
    assert not _job_processes(group, token)
