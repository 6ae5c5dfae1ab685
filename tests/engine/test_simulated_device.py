"""The simulated device (deepinfer/testing): a runner stand-in whose step returns at once and is ready
only after its set time T, with the engine's real host path around it; and benchmarks/host_overhead.py's
--json rows. No test here asserts a speed: the timing checks are of ordering (ready no sooner than the
deadline, the call returning before it) and of CPU time spent waiting."""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import subprocess
import sys
import time

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.errors import InvalidRequestError
from deepinfer.testing.simulated_device import SimulatedDevice, SimulatedDeviceError
from deepinfer.testing.simulated_engine import simulated_engine
from test_engine_core import WORDS, assert_all_blocks_free

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
REGEX = r"[a-z]{3}-\d{2,4}"


@pytest.fixture
def device():
    dev = SimulatedDevice(vocab_size=1000, step_s=0.3, num_blocks=64, block_size=4, seed=7)
    yield dev
    dev.close()


def _batch(tokens, starts, tables, rows, bs=4):
    return ForwardBatch.build(tokens, starts, tables, rows, bs)


def test_step_returns_at_once_and_is_ready_only_after_T(device):
    batch = _batch([[5, 6, 7], [8]], [0, 0], [[0], [1]], [2, 3])
    t0 = time.perf_counter()
    res = device.submit(device.prepare(batch))
    returned = time.perf_counter()
    assert returned < res.deadline  # the call did not wait for the step
    assert res.deadline - res.start == pytest.approx(0.3)
    assert not res.done()
    cpu0 = time.thread_time()
    logits = res.wait()
    assert time.perf_counter() >= res.deadline >= t0 + 0.3
    assert time.thread_time() - cpu0 < 0.15  # the wait slept: it did not spin for T
    assert res.done() and res.end >= res.deadline
    assert logits.shape == (2, 1000) and torch.isfinite(logits).all()


def test_forward_blocks_until_done(device):
    device.step_s = 0.05
    t0 = time.perf_counter()
    logits = device.forward(device.prepare(_batch([[1, 2]], [0], [[3]], [1])))
    assert time.perf_counter() - t0 >= 0.05 and logits.shape == (1, 1000)


def test_rows_depend_only_on_the_context(device):
    """A row is a function of its sequence's tokens: one prefill, or a chunked prefill then decodes
    over other blocks with the last input a placeholder, give the same logits row."""
    device.step_s = 0.0
    whole = device.forward(_batch([[11, 12, 13, 14, 15]], [0], [[0, 1]], [4])).clone()
    device.forward(_batch([[11, 12]], [0], [[5, 6]], []))  # a chunk that samples nothing
    device.forward(_batch([[13, 14]], [2], [[5, 6]], [1]))
    prev = torch.tensor([99, 15])  # the previous step's sampled tokens: placeholder -2 reads 15
    split = device.forward(_batch([[-2]], [4], [[5, 6]], [0]), prev)
    assert torch.equal(whole, split)
    other = device.forward(_batch([[11, 12, 13, 14, 16]], [0], [[2, 3]], [4]))
    assert not torch.equal(whole, other)  # another context, another row (64 pool rows: the seed makes this one differ)
    with pytest.raises(SimulatedDeviceError, match="placeholder"):
        device.forward(_batch([[-1]], [5], [[5, 6]], [0]))


def test_unsupported_options_are_typed_errors():
    with pytest.raises(InvalidRequestError, match="speculative"):
        simulated_engine(1, speculative="draft")
    with pytest.raises(InvalidRequestError, match="cpu"):
        simulated_engine(1, device="cuda")
    with pytest.raises(SimulatedDeviceError):
        SimulatedDevice(vocab_size=10, step_s=-1, num_blocks=4, block_size=1)


def test_engine_never_imports_the_stand_in():
    for path in (ROOT / "deepinfer").rglob("*.py"):
        if "testing" in path.relative_to(ROOT / "deepinfer").parts:
            continue
        assert "deepinfer.testing" not in path.read_text(), f"{path} imports the simulated device"


@pytest.fixture(scope="module")
def engines():
    built = {loop: simulated_engine(1, overlap_schedule=(loop == "overlap"), max_num_seqs=4, num_threads=1)
             for loop in ("sync", "overlap")}
    yield built
    for e in built.values():
        e.close()


@pytest.mark.parametrize("loop", ["sync", "overlap"])
def test_constrained_requests_end_with_valid_output(engines, loop):
    eng = engines[loop]
    outs = eng.generate(["Describe a person.", "Another person, please."] * 2,
                        [SamplingParams(temperature=0, max_tokens=200, json_schema=SCHEMA),
                         SamplingParams(temperature=0.8, seed=3, max_tokens=40, regex=REGEX)] * 2)
    for o in outs[0::2]:
        assert o.finish_reason == "stop" and o.valid is True, o.text
        value = json.loads(o.text)
        assert isinstance(value["name"], str) and 0 <= value["age"] <= 120
    for o in outs[1::2]:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    assert_all_blocks_free(eng)


def _workload(n: int, seed: int):
    r = random.Random(seed)
    prompts = [" ".join(r.choice(WORDS) for _ in range(r.randint(2, 30))) for _ in range(n)]
    params = []
    for i in range(n):
        kind = r.choice(["greedy", "seeded", "stop", "min", "json", "regex", "choices"])
        if kind == "greedy":
            params.append(SamplingParams(temperature=0, max_tokens=r.randint(1, 24), ignore_eos=True))
        elif kind == "seeded":
            params.append(SamplingParams(temperature=0.9, top_p=0.9, max_tokens=r.randint(1, 24), seed=i))
        elif kind == "stop":
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=24, stop=["e", "a"]))
        elif kind == "min":
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=12, min_tokens=8))
        elif kind == "json":
            params.append(SamplingParams(temperature=0.6, seed=i, max_tokens=120, json_schema=SCHEMA))
        elif kind == "regex":
            params.append(SamplingParams(temperature=0, max_tokens=30, regex=REGEX))
        else:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=8, choices=["alpha", "beta", "gamma delta"]))
    return prompts, params


@pytest.mark.parametrize("constrained", [False, True])
def test_sync_and_overlapped_outputs_identical(engines, constrained):
    prompts, params = _workload(14, seed=11)
    if not constrained:
        keep = [i for i, p in enumerate(params) if p.json_schema is None and p.regex is None and p.choices is None]
        prompts, params = [prompts[i] for i in keep], [params[i] for i in keep]
    outs = {loop: eng.generate(prompts, params) for loop, eng in engines.items()}
    a, b = outs["sync"], outs["overlap"]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert any(len(o.token_ids) > 1 for o in a)
    for eng in engines.values():
        assert_all_blocks_free(eng)


@pytest.mark.slow  # ~11 s: two engines built in a subprocess, each compiling the JSON schema
def test_benchmark_json_rows():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--batches", "2",
                           "--T-ms", "1", "--steps", "4", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(rows) == 4  # sync / overlap x unconstrained / json
    need = {"batch", "T_ms", "loop", "constrained", "host_us_per_seq", "device_idle", "tokens_per_s"}
    for r in rows:
        assert need <= r.keys()
        assert r["batch"] == 2 and r["T_ms"] == 1.0 and r["loop"] in ("sync", "overlap")
        assert isinstance(r["constrained"], bool) and r["host_us_per_seq"] > 0 and 0 <= r["device_idle"] <= 1
        assert r["tokens_per_s"] > 0
    assert {(r["loop"], r["constrained"]) for r in rows} == {(l, c) for l in ("sync", "overlap") for c in (False, True)}
    print(f"benchmark subprocess took {time.perf_counter() - t0:.1f} s")
