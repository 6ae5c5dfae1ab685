"""`deepinfer run` end to end on the default model, in subprocesses (small max_tokens)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROGS = os.path.join(HERE, "progs.py")


def cli(*args, timeout=240):
    cmd = [sys.executable, "-m", "deepinfer", "run", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def write_records(path, n, extra=()):
    lines = [json.dumps({"id": f"k{i}", "text": f"What is {i} plus {i}?"}) for i in range(n)]
    path.write_text("\n".join(list(lines) + list(extra)) + "\n")


def results(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_invalid_program_fails_fast_before_the_model_loads(tmp_path):
    write_records(tmp_path / "in.jsonl", 1)
    # a missing model would fail on load: the program error coming back shows nothing was loaded
    for spec, msg in [(f"{PROGS}:nope", "no function 'nope'"), ("missing_file.py:f", "does not exist")]:
        t = time.monotonic()
        r = cli(spec, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                "--model", str(tmp_path / "no_model.gguf"))
        assert r.returncode == 2, r.stderr
        assert msg in r.stderr and "ModelLoadError" not in r.stderr
        assert time.monotonic() - t < 60
        assert not (tmp_path / "o.jsonl").exists()


def test_usage_errors_exit_2(tmp_path):
    write_records(tmp_path / "in.jsonl", 1)
    (tmp_path / "o.jsonl").write_text('{"id": "k0"}\n')
    r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "--resume" in r.stderr
    r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"))  # no --output
    assert r.returncode == 2 and "--output" in r.stderr


def test_run_ordered_with_bad_lines(tmp_path):
    write_records(tmp_path / "in.jsonl", 5, extra=["not json", json.dumps({"id": "nofield"})])
    r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
            "--ordered", "--temperature", "0", "--max-tokens", "3", "--kv-cache-memory", "128")
    assert r.returncode == 1, r.stderr  # some records failed
    assert "7 records (5 ok, 2 failed)" in r.stderr
    out = results(tmp_path / "o.jsonl")
    assert [o["id"] for o in out] == [f"k{i}" for i in range(5)] + [6, "nofield"]
    for o in out[:5]:
        assert o["ok"] and 1 <= len(o["variables"]["answer"]) and o["variables"]["tag"] == "x"
    assert not out[5]["ok"] and "not valid JSON" in out[5]["error"]
    assert not out[6]["ok"] and "'text'" in out[6]["error"]


def test_kill_9_then_resume_writes_every_record_once(tmp_path):
    n = 24
    write_records(tmp_path / "in.jsonl", n)
    out = tmp_path / "o.jsonl"
    args = [f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--batch-size", "1",
            "--max-tokens", "4", "--temperature", "0", "--kv-cache-memory", "128", "--log-interval", "0.5"]
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer", "run", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = out.read_text()
    n_before = first.count("\n")
    assert 3 <= n_before < n
    with open(out, "a") as f:  # as if the kill landed mid-write
        f.write('{"id": "k' + str(n - 1) + '", "ok": tr')
    r = cli(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert "half-written" in r.stderr and f"{n_before} skipped" in r.stderr
    ids = [o["id"] for o in results(out)]
    assert sorted(ids) == sorted(f"k{i}" for i in range(n)) and len(ids) == n
    assert out.read_text().startswith(first)  # earlier results untouched
    assert "rec/s" in r.stderr and "tok/s" in r.stderr  # plain log lines when not a terminal


def test_speculative_run_writes_the_same_records(tmp_path):
    write_records(tmp_path / "in.jsonl", 4)
    outs = []
    for name, extra in (("plain", ()), ("spec", ("--speculative", "ngram"))):
        r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"{name}.jsonl"),
                "--ordered", "--temperature", "0", "--max-tokens", "12", "--kv-cache-memory", "128", *extra)
        assert r.returncode == 0, r.stderr
        outs.append(results(tmp_path / f"{name}.jsonl"))
    assert outs[0] == outs[1] and len(outs[0]) == 4
    r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "x.jsonl"),
            "--speculative", "eagle")
    assert r.returncode == 2 and "--speculative" in r.stderr


def test_precision_and_kv_cache_type_reach_the_engine(tmp_path):
    write_records(tmp_path / "in.jsonl", 2)
    seen = {}
    for name, extra in (("int8", ("--dtype", "quantized")),
                        ("int8-f32kv", ("--dtype", "quantized", "--kv-cache-dtype", "float32")),
                        ("default", ())):
        r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"{name}.jsonl"),
                "--temperature", "0", "--max-tokens", "3", "--kv-cache-memory", "64", *extra)
        assert r.returncode == 0, r.stderr
        assert len(results(tmp_path / f"{name}.jsonl")) == 2
        seen[name] = next(l for l in r.stderr.splitlines() if "precision" in l)
    assert "precision quantized-int8, KV cache bfloat16" in seen["int8"]
    assert "precision quantized-int8, KV cache float32" in seen["int8-f32kv"]
    assert "precision quantized-exact, KV cache float32" in seen["default"]
    r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "x.jsonl"),
            "--kv-cache-dtype", "fp8")
    assert r.returncode == 2 and "--kv-cache-dtype" in r.stderr


def test_fp8_weights_reach_the_engine(tmp_path):
    pytest.importorskip("transformers")
    from fp8_factory import fp8_checkpoint
    from model_factory import make_tiny_model

    model = tmp_path / "fp8"
    fp8_checkpoint(make_tiny_model(tmp_path / "src", "llama"), model)
    write_records(tmp_path / "in.jsonl", 2)
    seen = {}
    for name, extra in (("keep", ("--fp8-weights", "keep")), ("default", ())):
        r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"{name}.jsonl"),
                "--model", str(model), "--ordered", "--temperature", "0", "--max-tokens", "3", "--kv-cache-memory", "8",
                *extra)
        assert r.returncode == 0, r.stderr
        seen[name] = (next(line for line in r.stderr.splitlines() if "precision" in line),
                      results(tmp_path / f"{name}.jsonl"))
    assert "precision float32+fp8-weights" in seen["keep"][0]
    assert "precision float32," in seen["default"][0]  # CPU auto: dequantised at load
    assert seen["keep"][1] == seen["default"][1] and len(seen["keep"][1]) == 2
    r = cli(f"{PROGS}:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "x.jsonl"),
            "--fp8-weights", "e4m3")
    assert r.returncode == 2 and "--fp8-weights" in r.stderr
