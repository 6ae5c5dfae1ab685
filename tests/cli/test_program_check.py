"""`deepinfer run` runs the compiler's ahead-of-time checks on the first record: a program error that
every record would hit exits 2 naming the program line, before any model loads."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BAD = '''
import deepinfer as di

@di.function
def bad_regex(s, text):
    s += "Q: " + text + "\\nA: "
    s += di.gen("a", regex="[0-9", max_tokens=4)

@di.function
def undefined(s, text):
    s += "Q: " + text + di.gen("a", max_tokens=4)
    s += "Again: " + s["answer"]

@di.function
def per_record(s, text, pattern="[0-9]+"):
    s += "Q: " + text + di.gen("a", regex=pattern, max_tokens=4)
'''


def _run(tmp_path, name, records):
    (tmp_path / "progs.py").write_text(BAD)
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    cmd = [sys.executable, "-m", "deepinfer", "run", f"{tmp_path / 'progs.py'}:{name}", "--input",
           str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "no_model.gguf")]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name, line, msg", [("bad_regex", 7, "regex"), ("undefined", 12, "'answer'")])
def test_static_program_errors_exit_2_naming_the_line(tmp_path, name, line, msg):
    r = _run(tmp_path, name, [{"id": 1, "text": "hi"}])
    assert r.returncode == 2, r.stderr
    assert f"line {line}" in r.stderr and msg in r.stderr and "ModelLoadError" not in r.stderr
    assert r.stderr.count(f"line {line}") == 1, r.stderr  # was "line 12: line 12: ..." for 'undefined'


def test_an_error_that_depends_on_the_record_is_left_to_that_record(tmp_path):
    # the bad regex comes from the record: other records may be fine, so the job starts (and then
    # fails to load the missing model, which shows the check let it through)
    r = _run(tmp_path, "per_record", [{"id": 1, "text": "hi", "pattern": "[0-9"}])
    assert "program check failed" not in r.stderr
    assert "ModelLoadError" in r.stderr or "model" in r.stderr.lower()
