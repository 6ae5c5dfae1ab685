"""`deepinfer run-batch`: OpenAI batch files on a tiny random model (real engine, small max_tokens)."""

import json
import os
import subprocess
import sys

import pytest

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.jobs import JobOptions, JobUsageError
from deepinfer.jobs.batch_runner import run_batch_job
from deepinfer.jobs.openai_batch import BatchRequestError, engine_requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def req(cid, url, body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def msgs(text):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


MIXED = [
    req("chat-greedy", CHAT, {"model": "m", "messages": msgs("Hello"), "max_tokens": 6, "temperature": 0}),
    req("chat-n2", CHAT, {"messages": msgs("Paris is"), "max_tokens": 5, "temperature": 0.9, "seed": 7, "n": 2}),
    req("chat-logprobs", CHAT, {"messages": msgs("Hi"), "max_tokens": 4, "temperature": 0, "logprobs": True,
                                "top_logprobs": 2}),
    req("comp", COMP, {"prompt": "The quick brown", "max_tokens": 5, "temperature": 0, "logprobs": 1, "stop": ["\n"]}),
    req("comp-2prompts", COMP, {"prompt": ["Hello", "def add"], "max_tokens": 3, "temperature": 0.7, "top_p": 0.9}),
    req("schema", CHAT, {"messages": msgs("JSON please"), "max_tokens": 24, "temperature": 0,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}),
    req("jsonobj", COMP, {"prompt": "{", "max_tokens": 16, "temperature": 0.5,
                          "response_format": {"type": "json_object"}}),
    "{this is not json",
    json.dumps({"method": "POST", "url": CHAT, "body": {"messages": msgs("x")}}),  # no custom_id
    req("bad-url", "/v1/embeddings", {"input": "x"}),
    req("bad-temp", CHAT, {"messages": msgs("x"), "temperature": "hot"}),
    req("unsupported", CHAT, {"messages": msgs("x"), "tools": []}),
    req("no-messages", CHAT, {"max_tokens": 3}),
]
GOOD = ["chat-greedy", "chat-n2", "chat-logprobs", "comp", "comp-2prompts", "schema", "jsonobj"]


@pytest.fixture(scope="module")
def engine(tiny_models):
    from deepinfer import Engine

    # batch-invariant GEMMs: a request's logits do not depend on the batch it shares, so the
    # job's windowed batches and one Engine.generate call may be compared token for token
    return Engine(str(tiny_models["llama"]), kv_cache_memory=32 << 20, batch_invariant=True)


def opts(tmp_path, **kw):
    base = dict(input=str(tmp_path / "batch.jsonl"), output=str(tmp_path / "out.jsonl"), progress=False,
                batch_size=3)
    base.update(kw)
    return JobOptions(**base)


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")


def read(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def check_shape(line):
    """The OpenAI batch output line shape (https://platform.openai.com/docs/api-reference/batch)."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_")
    assert line["custom_id"] is None or isinstance(line["custom_id"], str)
    assert (line["response"] is None) != (line["error"] is None)
    if line["error"] is not None:
        assert set(line["error"]) == {"code", "message"} and all(isinstance(v, str) for v in line["error"].values())
        return
    resp = line["response"]
    assert set(resp) == {"status_code", "request_id", "body"} and isinstance(resp["request_id"], str)
    body = resp["body"]
    if resp["status_code"] != 200:
        assert resp["status_code"] in (400, 500)
        assert set(body) == {"error"} and {"message", "type", "param", "code"} == set(body["error"])
        return
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] in ("chat.completion", "text_completion") and isinstance(body["created"], int)
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    for c in body["choices"]:
        assert c["finish_reason"] in ("stop", "length")
        if body["object"] == "chat.completion":
            assert set(c) == {"index", "message", "logprobs", "finish_reason"}
            assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
            if c["logprobs"] is not None:
                for t in c["logprobs"]["content"]:
                    assert set(t) == {"token", "logprob", "bytes", "top_logprobs"} and t["logprob"] <= 0
                    assert all(set(a) == {"token", "logprob", "bytes"} for a in t["top_logprobs"])
        else:
            assert set(c) == {"index", "text", "logprobs", "finish_reason"} and isinstance(c["text"], str)
            if c["logprobs"] is not None:
                lp = c["logprobs"]
                assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
                assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])


def reference(engine, rec):
    """What Engine.generate returns for the same request, written by hand from the body."""
    b, url = rec["body"], rec["url"]
    base = {"max_tokens": b.get("max_tokens", 256)}
    for k in ("temperature", "top_p", "stop"):
        if k in b:
            base[k] = b[k]
    rf = b.get("response_format") or {}
    if rf.get("type") == "json_schema":
        base["json_schema"] = rf["json_schema"]["schema"]
    if rf.get("type") == "json_object":
        base["json_object"] = True
    if url == CHAT and b.get("logprobs"):
        base["logprobs"] = b.get("top_logprobs", 0)
    if url == COMP and "logprobs" in b:
        base["logprobs"] = b["logprobs"]
    prompts = [b["messages"]] if url == CHAT else ([b["prompt"]] if isinstance(b["prompt"], str) else b["prompt"])
    n = b.get("n", 1)
    seeds = [b["seed"] + i for i in range(n)] if "seed" in b else None
    if seeds is None:  # the job derives them from (job seed 0, custom_id)
        seeds = [p.seed for _, p in engine_requests(url, b, rec["custom_id"])[:n]]
    pairs = [(p, SamplingParams(**base, seed=s)) for p in prompts for s in seeds]
    return engine.generate([p for p, _ in pairs], [sp for _, sp in pairs])


def test_mixed_file_shapes_errors_and_equality_with_generate(tmp_path, engine):
    write(tmp_path / "batch.jsonl", MIXED)
    s = run_batch_job(opts(tmp_path), engine)
    out = read(tmp_path / "out.jsonl")
    assert len(out) == len(MIXED) and s.processed == len(MIXED) and s.failed == len(MIXED) - len(GOOD)
    for line in out:
        check_shape(line)
    assert len({l["id"] for l in out}) == len(out)
    by_id = {l["custom_id"]: l for l in out if l["custom_id"] is not None}
    # bad lines: error objects naming the problem; the rest ran
    bad_json, no_cid = [l for l in out if l["custom_id"] is None]
    assert "not valid JSON" in bad_json["error"]["message"] and "line 8" in bad_json["error"]["message"]
    assert "no custom_id" in no_cid["error"]["message"]
    assert "unknown url '/v1/embeddings'" in by_id["bad-url"]["error"]["message"]
    for cid, words in (("bad-temp", "temperature"), ("unsupported", "tools"), ("no-messages", "messages")):
        r = by_id[cid]["response"]
        assert r["status_code"] == 400 and words in r["body"]["error"]["message"], r
    lines = {json.loads(l)["custom_id"]: json.loads(l) for l in MIXED[:7]}
    for cid in GOOD:
        body = by_id[cid]["response"]["body"]
        ref = reference(engine, lines[cid])
        texts = [c.get("message", {}).get("content") if "message" in c else c["text"] for c in body["choices"]]
        assert texts == [o.text for o in ref], cid
        assert body["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in ref)
        assert [c["finish_reason"] for c in body["choices"]] == [o.finish_reason for o in ref]
    # n=2 with a seed: two choices with seeds 7 and 8; logprobs carry top alternatives
    assert len(by_id["chat-n2"]["response"]["body"]["choices"]) == 2
    assert len(by_id["comp-2prompts"]["response"]["body"]["choices"]) == 2
    lp = by_id["chat-logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert lp and all(len(t["top_logprobs"]) == 2 for t in lp)
    comp_lp = by_id["comp"]["response"]["body"]["choices"][0]["logprobs"]
    assert "".join(comp_lp["tokens"]) == by_id["comp"]["response"]["body"]["choices"][0]["text"]
    schema_text = by_id["schema"]["response"]["body"]["choices"][0]["message"]["content"]
    if by_id["schema"]["response"]["body"]["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(schema_text)["a"], int)


def test_resume_writes_each_custom_id_once(tmp_path, engine):
    write(tmp_path / "batch.jsonl", MIXED)
    run_batch_job(opts(tmp_path, output=str(tmp_path / "full.jsonl")), engine)
    full = read(tmp_path / "full.jsonl")
    # as if killed after 4 lines, mid-way through the 5th
    text = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "out.jsonl").write_text("".join(text[:4]) + text[4][:20])
    s = run_batch_job(opts(tmp_path, resume=True), engine)
    out = read(tmp_path / "out.jsonl")
    assert s.skipped == 4 and s.processed == len(MIXED) - 4 and s.truncated_bytes == 20
    assert sorted(l["id"] for l in out) == sorted(l["id"] for l in full) and len(out) == len(MIXED)

    def strip(line):  # `created` is a timestamp
        line = json.loads(json.dumps(line))
        if line["response"] and "created" in line["response"]["body"]:
            del line["response"]["body"]["created"]
        return line

    assert sorted(map(json.dumps, map(strip, out))) == sorted(map(json.dumps, map(strip, full)))


def test_duplicate_custom_ids_and_bodies_refused(tmp_path):
    write(tmp_path / "batch.jsonl", [req("a", CHAT, {"messages": msgs("x")}), req("a", COMP, {"prompt": "y"})])
    with pytest.raises(JobUsageError, match="'a' appears on lines 1 and 2"):
        run_batch_job(opts(tmp_path), engine=None)
    for body, msg in [({"messages": []}, "messages"), ({"messages": msgs("x"), "n": 0}, "body.n"),
                      ({"messages": msgs("x"), "top_logprobs": 2}, "logprobs"),
                      ({"messages": msgs("x"), "response_format": {"type": "xml"}}, "response_format"),
                      ({"messages": msgs("x"), "stream": True}, "stream")]:
        with pytest.raises(BatchRequestError, match=msg):
            engine_requests(CHAT, body, "c")
    with pytest.raises(BatchRequestError, match="prompt"):
        engine_requests(COMP, {"prompt": 3}, "c")


def test_cli_run_batch(tmp_path, tiny_models):
    write(tmp_path / "batch.jsonl", MIXED[:2] + [MIXED[9]])
    cmd = [sys.executable, "-m", "deepinfer", "run-batch", "-i", str(tmp_path / "batch.jsonl"),
           "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_models["llama"]), "--kv-cache-memory", "32"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stderr  # one line failed
    assert "3 records (2 ok, 1 failed)" in r.stderr
    out = read(tmp_path / "out.jsonl")
    assert sorted(l["custom_id"] for l in out) == ["bad-url", "chat-greedy", "chat-n2"]
    # without ray importable, --ray says how to install it (before any model loads)
    code = ("import sys; sys.modules['ray'] = None; from deepinfer.cli import main; "
            f"sys.exit(main({cmd[3:-4] + ['--ray', '--replicas', '2']!r}))")
    (tmp_path / "out.jsonl").unlink()
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 2 and "pip install 'deepinfer[ray]'" in r.stderr, r.stderr


def test_engine_driver_fails_only_the_refused_group_and_aborts_on_close(engine):
    from deepinfer.errors import PromptTooLongError
    from deepinfer.jobs.engine_driver import EngineDriver

    greedy = SamplingParams(max_tokens=4, temperature=0)
    with EngineDriver(engine) as d:
        ok = d.submit([("Hello", greedy), ("Paris", greedy)])
        bad = d.submit([("Hi", greedy), ([5] * 600, greedy)])  # the tiny model's context is 512
        got = [o.text for o in ok.result(60)]
        assert isinstance(bad.exception(60), PromptTooLongError)
    # the driver thread has stopped: the engine is this thread's again
    assert got == [o.text for o in engine.generate(["Hello", "Paris"], greedy)]
    d = EngineDriver(engine)
    long = d.submit([("Hello", SamplingParams(max_tokens=400, ignore_eos=True))])
    d.close(abort=True)
    assert isinstance(long.exception(60), RuntimeError) and not engine.has_unfinished()
