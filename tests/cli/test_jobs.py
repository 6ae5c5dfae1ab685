"""The job runner's logic (records, resume, ordering, errors) on the instant FakeEngine."""

import json
import time
import os

import pytest

from deepinfer.jobs import JobOptions, JobUsageError, load_program, run_job
from deepinfer.jobs.output import recover
from deepinfer.lang.testing import FakeEngine

HERE = os.path.dirname(os.path.abspath(__file__))


def prog(name):
    return load_program(os.path.join(HERE, "progs.py") + ":" + name)


def write_lines(path, lines):
    path.write_text("".join(l + "\n" for l in lines))


def read_results(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def records(n, start=0):
    return [json.dumps({"id": f"k{i}", "text": f"question {i}"}) for i in range(start, start + n)]


def opts(tmp_path, **kw):
    base = dict(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out.jsonl"), progress=False,
                sampling={"temperature": 0.0})
    base.update(kw)
    return JobOptions(**base)


def test_every_record_written_once_with_id_and_variables(tmp_path):
    write_lines(tmp_path / "in.jsonl", records(30))
    s = run_job(prog("echo"), opts(tmp_path, batch_size=4), FakeEngine())
    out = read_results(tmp_path / "out.jsonl")
    assert s.processed == 30 and s.failed == 0 and s.tokens > 0
    assert sorted(r["id"] for r in out) == sorted(f"k{i}" for i in range(30))
    for r in out:
        assert r["ok"] and isinstance(r["variables"]["answer"], str) and r["variables"]["tag"] == "x"


def test_line_number_is_the_id_without_an_id_field(tmp_path):
    write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "a"}), "", json.dumps({"text": "b"})])
    run_job(prog("echo"), opts(tmp_path), FakeEngine())
    assert sorted(r["id"] for r in read_results(tmp_path / "out.jsonl")) == [1, 3]  # blank line 2 skipped


def test_bad_lines_and_raising_programs_become_error_records(tmp_path):
    lines = [json.dumps({"id": 1, "text": "fine"}), "{not json", json.dumps({"id": 3, "txt": "typo"}),
             json.dumps({"id": 4, "text": "boom"}), json.dumps([1, 2]), json.dumps({"id": 6, "text": "ok"})]
    write_lines(tmp_path / "in.jsonl", lines)
    s = run_job(prog("explode"), opts(tmp_path), FakeEngine())
    by_id = {r["id"]: r for r in read_results(tmp_path / "out.jsonl")}
    assert s.processed == 6 and s.failed == 4
    assert by_id[1]["ok"] and by_id[6]["ok"]
    assert "not valid JSON" in by_id[2]["error"]
    assert "'text'" in by_id[3]["error"] and "txt" in by_id[3]["error"]
    assert "ValueError" in by_id[4]["error"] and "boom" in by_id[4]["error"]
    assert "answer" in by_id[4]["variables"]  # what it generated before raising is kept
    assert "not an object" in by_id[5]["error"]


def test_map_and_field(tmp_path):
    write_lines(tmp_path / "in.jsonl", [json.dumps({"id": i, "body": f"t{i}", "label": "L"}) for i in range(3)])
    run_job(prog("echo"), opts(tmp_path, mapping={"body": "text", "label": "tag"}), FakeEngine())
    assert {r["variables"]["tag"] for r in read_results(tmp_path / "out.jsonl")} == {"L"}
    os.remove(tmp_path / "out.jsonl")
    run_job(prog("whole"), opts(tmp_path, field="rec"), FakeEngine())
    assert [r["variables"]["n_fields"] for r in read_results(tmp_path / "out.jsonl")] == [3, 3, 3]


def test_ordered_writes_in_input_order(tmp_path):
    # early records get long outputs, so they finish last
    write_lines(tmp_path / "in.jsonl", records(12))

    def respond(prompt, params):
        i = int(prompt.rsplit("question ", 1)[1].split("\n")[0])
        return "word " * (12 - i)

    run_job(prog("echo"), opts(tmp_path, batch_size=12, sampling={"max_tokens": 40}), FakeEngine(respond=respond))
    unordered = [r["id"] for r in read_results(tmp_path / "out.jsonl")]
    os.remove(tmp_path / "out.jsonl")
    run_job(prog("echo"), opts(tmp_path, batch_size=12, ordered=True, sampling={"max_tokens": 40}),
            FakeEngine(respond=respond))
    ordered = [r["id"] for r in read_results(tmp_path / "out.jsonl")]
    assert ordered == [f"k{i}" for i in range(12)]
    assert unordered != ordered  # the scenario does reorder completions


def test_existing_output_needs_resume(tmp_path):
    write_lines(tmp_path / "in.jsonl", records(2))
    (tmp_path / "out.jsonl").write_text('{"id": "k0", "ok": true}\n')
    with pytest.raises(JobUsageError, match="--resume"):
        run_job(prog("echo"), opts(tmp_path), FakeEngine())


@pytest.mark.parametrize("ordered", [False, True])
def test_resume_skips_written_and_redoes_half_line(tmp_path, ordered):
    write_lines(tmp_path / "in.jsonl", records(10))
    done = [json.dumps({"id": f"k{i}", "ok": True, "variables": {}}) for i in (0, 3, 4)]
    (tmp_path / "out.jsonl").write_text("\n".join(done) + '\n{"id": "k7", "ok": tr')
    s = run_job(prog("echo"), opts(tmp_path, resume=True, ordered=ordered), FakeEngine())
    out = read_results(tmp_path / "out.jsonl")
    ids = [r["id"] for r in out]
    assert s.skipped == 3 and s.processed == 7 and s.truncated_bytes > 0
    assert sorted(ids) == sorted(f"k{i}" for i in range(10)) and len(ids) == len(set(ids))
    if ordered:
        assert ids[3:] == [f"k{i}" for i in (1, 2, 5, 6, 7, 8, 9)]


def test_recover_on_missing_and_clean_files(tmp_path):
    assert recover(str(tmp_path / "nope.jsonl")) == (set(), 0)
    p = tmp_path / "o.jsonl"
    p.write_text('{"id": 1}\n{"id": "1"}\n')
    ids, cut = recover(str(p))
    assert len(ids) == 2 and cut == 0  # 1 and "1" are different ids


def test_limit_and_seed(tmp_path):
    write_lines(tmp_path / "in.jsonl", records(10))
    eng = FakeEngine()
    s = run_job(prog("echo"), opts(tmp_path, limit=4, seed=7), eng)
    assert s.processed == 4
    seeds = [params.seed for _, _, params in eng.log]
    assert len(set(seeds)) == 4 and None not in seeds


class _SlowStepEngine(FakeEngine):
    """Each step takes real time (sleeping releases the GIL), as a model's forward pass does, so the
    submitting thread runs while programs are in flight: with an instant engine a program can finish
    before the next is submitted, and the window would never fill."""

    slow_steps = 0

    def step(self):
        time.sleep(0.003)
        self.slow_steps += 1
        return super().step()


def test_window_bounds_programs_in_flight(tmp_path):
    write_lines(tmp_path / "in.jsonl", records(40))
    eng = _SlowStepEngine(tokens_per_step=1)
    run_job(prog("echo"), opts(tmp_path, batch_size=5), eng)
    assert eng.slow_steps > 0
    assert 1 < eng.max_running <= 5


@pytest.mark.parametrize("spec, msg", [
    ("nofile.py:f", "does not exist"),
    ("progs.py", "FILE.py:FUNCTION"),
    ("progs.py:missing", "no function 'missing'"),
    ("progs.py:not_a_program", "not a @deepinfer.function"),
    ("no_such_module_xyz:f", "cannot import module"),
])
def test_bad_program_specs(spec, msg):
    if spec.startswith("progs.py"):
        spec = os.path.join(HERE, spec)
    with pytest.raises(JobUsageError, match=msg):
        load_program(spec)


def test_bad_options(tmp_path):
    write_lines(tmp_path / "in.jsonl", records(1))
    with pytest.raises(JobUsageError, match="no argument 'nope'"):
        run_job(prog("echo"), opts(tmp_path, mapping={"text": "nope"}), FakeEngine())
    with pytest.raises(JobUsageError, match="does not exist"):
        run_job(prog("echo"), opts(tmp_path, input=str(tmp_path / "missing.jsonl")), FakeEngine())
    with pytest.raises(JobUsageError, match="top_p"):
        run_job(prog("echo"), opts(tmp_path, sampling={"top_p": 3.0}), FakeEngine())


def test_progress_log_line_and_bar():
    import io

    from deepinfer.jobs.progress import Progress

    buf = io.StringIO()  # not a terminal: plain log lines
    p = Progress(total=10, already_done=2, stream=buf, log_interval=0.0)
    p.update(True, 5)
    p.update(False, 3)
    line = buf.getvalue().strip().splitlines()[-1]
    assert "4/10 records" in line and "rec/s" in line and "tok/s" in line and "1 failed" in line and "ETA" in line
    bar_buf = io.StringIO()
    bar = Progress(total=4, stream=bar_buf, use_bar=True)
    bar.update(True, 7)
    bar.close()
    assert "1/4" in bar_buf.getvalue() and "tok/s" in bar_buf.getvalue()


def test_cli_main_usage(capsys):
    from deepinfer.cli import main

    assert main([]) == 2
    assert main(["run", "--help"]) == 0
    assert "--resume" in capsys.readouterr().out
    assert main(["run", os.path.join(HERE, "progs.py") + ":echo", "--input", "x.jsonl"]) == 2  # no --output


def test_function_submit_returns_a_future_per_run():
    from concurrent.futures import Future

    eng = FakeEngine()
    echo = prog("echo")
    futs = [echo.submit(text=f"q{i}", backend=eng, max_tokens=3) for i in range(5)]
    assert all(isinstance(f, Future) for f in futs)
    states = [f.result(timeout=30) for f in futs]
    assert all(st.ok for st in states)
    assert [st.text().split("Q: ")[1].split("\n")[0] for st in states] == [f"q{i}" for i in range(5)]
    assert all(p.max_tokens == 4 for _, _, p in eng.log)  # the gen's own max_tokens beats the default
