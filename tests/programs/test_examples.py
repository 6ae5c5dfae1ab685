"""The examples/ scripts run on the default model (in-process on the session engine; the
extraction example through the `deepinfer run` CLI in a subprocess)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # msgspec resolves a Struct's annotations through its module
    spec.loader.exec_module(mod)
    return mod


def test_quickstart(engine, capsys):
    mod = load("quickstart")
    mod.main(engine)
    out = capsys.readouterr().out
    season = re.search(r"season:\s+(\w+)", out)
    assert season and season[1] in ("spring", "summer", "autumn", "winter")
    assert "facts:       City(" in out
    assert "['system', 'user', 'assistant', 'user', 'assistant', 'user', 'assistant']" in out
    assert "batch of 4 programs" in out


def test_agent_react_with_tools(engine):
    mod = load("agent")
    states = mod.react.run_batch([{"question": q} for q in mod.QUESTIONS[:1]], backend=engine, temperature=0)
    for st in states:
        assert st.ok, st.error()
        for step in st["trace"]:
            assert step["action"] in mod.TOOLS
            schema, tool = mod.TOOLS[step["action"]]
            # the arguments were generated under the tool's schema and the tool ran on them
            assert step["observation"] == tool(__import__("msgspec").convert(step["args"], schema))
        assert len(st["trace"]) <= 3 and isinstance(st["answer"], str)


def test_tree_search(engine, capsys):
    mod = load("tree_search")
    st = mod.tree_search.run("Plan a picnic.", width=3, depth=2, backend=engine)
    assert st.ok, st.error()
    assert len(st["path"]) == 2 and all(len(sc) == 3 for sc in st["scores"])
    text = st.text()
    for level, (step, scores) in enumerate(zip(st["path"], st["scores"]), 1):
        assert step in text  # the best branch's step was kept in the parent
    # the kept step is the best-scored branch of its level
    assert st["step"][max(range(3), key=st["scores"][-1].__getitem__)].strip() == st["path"][-1]


def test_extract_through_cli(tmp_path):
    out = tmp_path / "reviews_out.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "deepinfer", "run", "examples/extract.py:extract", "--input",
         "examples/data/reviews.jsonl", "--output", str(out), "--limit", "3", "--temperature", "0",
         "--kv-cache-memory", "128", "--ordered"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    mod = load("extract")
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [x["id"] for x in rows] == ["r01", "r02", "r03"]
    import msgspec

    for x in rows:
        review = msgspec.convert(x["variables"]["review"], mod.Review)  # validates every constraint
        assert review.sentiment in ("positive", "negative", "mixed") and 1 <= review.rating <= 5


def test_reviews_data_file():
    rows = [json.loads(l) for l in open(os.path.join(EXAMPLES, "data", "reviews.jsonl"))]
    assert 30 <= len(rows) <= 40
    assert len({r["id"] for r in rows}) == len(rows) and all(r["text"] for r in rows)
