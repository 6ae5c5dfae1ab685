"""Issue 21, cases 3 and 5: --resume can never skip an unprocessed record, and an unusable
--output is a usage error (exit 2) before the model loads."""

from __future__ import annotations

import json
import os

import pytest

from deepinfer.cli import main
from deepinfer.jobs import JobOptions, JobUsageError, load_program, run_job
from deepinfer.lang.testing import FakeEngine

HERE = os.path.dirname(os.path.abspath(__file__))
ECHO = os.path.join(HERE, "progs.py") + ":echo"


def _opts(tmp_path, **kw):
    base = dict(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out.jsonl"), progress=False,
                sampling={"temperature": 0.0})
    base.update(kw)
    return JobOptions(**base)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def _results(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- case 3: implicit (line-number) ids never collide with explicit ids -------------------------
COLLIDING = [
    # line 1 has no id (implicit id 1); line 2's explicit id is 1
    [json.dumps({"text": "a"}), json.dumps({"id": 1, "text": "b"})],
    # an unparseable line 1 gets implicit id 1 too
    ["{not json", json.dumps({"id": 1, "text": "b"})],
    # and the other way round: explicit id 2 on line 1, no id on line 2
    [json.dumps({"id": 2, "text": "a"}), json.dumps({"text": "b"})],
]


@pytest.mark.parametrize("lines", COLLIDING)
@pytest.mark.parametrize("done_line", [1, 2])
def test_resume_after_either_colliding_record_redoes_the_other(tmp_path, lines, done_line):
    _write(tmp_path / "in.jsonl", lines)
    run_job(load_program(ECHO), _opts(tmp_path), FakeEngine())
    full = _results(tmp_path / "out.jsonl")
    assert sorted(r["line"] for r in full) == [1, 2]
    # as if killed after writing only the record of done_line
    kept = [r for r in full if r["line"] == done_line]
    _write(tmp_path / "out.jsonl", [json.dumps(r) for r in kept])
    s = run_job(load_program(ECHO), _opts(tmp_path, resume=True), FakeEngine())
    assert s.skipped == 1 and s.processed == 1
    assert sorted(r["line"] for r in _results(tmp_path / "out.jsonl")) == [1, 2]


def test_resume_of_a_finished_job_redoes_nothing(tmp_path):
    _write(tmp_path / "in.jsonl", [json.dumps({"text": "a"}), json.dumps({"id": 1, "text": "b"}), "[1]",
                                   json.dumps({"id": "1", "text": "c"})])
    run_job(load_program(ECHO), _opts(tmp_path), FakeEngine())
    s = run_job(load_program(ECHO), _opts(tmp_path, resume=True), FakeEngine())
    assert s.processed == 0 and s.skipped == 4
    assert len(_results(tmp_path / "out.jsonl")) == 4


def test_duplicate_explicit_ids_are_refused_before_anything_runs(tmp_path):
    _write(tmp_path / "in.jsonl", [json.dumps({"id": "a", "text": "x"}), json.dumps({"text": "y"}),
                                   json.dumps({"id": "a", "text": "z"})])
    with pytest.raises(JobUsageError, match=r"id 'a' appears on lines 1 and 3"):
        run_job(load_program(ECHO), _opts(tmp_path), FakeEngine())
    assert not (tmp_path / "out.jsonl").exists()
    # ids 1 and "1" are different ids; a duplicate past --limit is never read
    run_job(load_program(ECHO), _opts(tmp_path, limit=2), FakeEngine())


def test_cli_refuses_duplicate_ids_with_exit_2(tmp_path, capsys):
    _write(tmp_path / "in.jsonl", [json.dumps({"id": 7, "text": "x"}), json.dumps({"id": 7, "text": "y"})])
    rc = main(["run", ECHO, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"), "-q"])
    assert rc == 2 and "appears on lines 1 and 2" in capsys.readouterr().err


# ---- case 5: unusable output paths --------------------------------------------------------------
@pytest.mark.parametrize("bad", ["afile/out.jsonl", "missing/dir/out.jsonl", "/proc/out.jsonl"])
def test_unusable_output_is_a_usage_error_before_the_model_loads(tmp_path, capsys, monkeypatch, bad):
    _write(tmp_path / "in.jsonl", [json.dumps({"text": "x"})])
    (tmp_path / "afile").write_text("not a directory")
    monkeypatch.chdir(tmp_path)

    def no_engine(*a, **kw):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr("deepinfer.engine.engine.Engine", no_engine)
    rc = main(["run", ECHO, "--input", "in.jsonl", "--output", bad, "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot write the output file" in err and "Traceback" not in err
    assert not os.path.exists("missing")


def test_output_probe_leaves_no_file_behind(tmp_path):
    _write(tmp_path / "in.jsonl", [json.dumps({"text": "x"})])
    from deepinfer.jobs import validate_options

    validate_options(load_program(ECHO), _opts(tmp_path))
    assert not (tmp_path / "out.jsonl").exists()
