"""OpenAI batch input lines -> engine requests.

A line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}`. `to_batch_record` never raises: a line that is not such a request becomes a
Record with `error` set (the job writes an error line for it). `engine_requests` turns a body
into (prompt, SamplingParams) pairs, one per choice (`n`) and prompt, or raises
`BatchRequestError` naming the field.

Seeds: choice i of a body with `seed` samples with seed + i (so n=1 is exactly the body's seed);
without one, from (the job's --seed or 0, custom_id, i), so a record's output never depends on
the records batched with it or on which replica ran it.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import InvalidRequestError
from deepinfer.jobs.records import Record, id_key

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)


class BatchRequestError(InvalidRequestError):
    """A batch line's body asks for something invalid or unsupported (HTTP 400 in its output line)."""


# fields accepted and ignored: they do not change what is generated
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options"}
_COMMON = {"max_tokens", "temperature", "top_p", "seed", "stop", "n", "presence_penalty",
           "frequency_penalty", "response_format"}
_CHAT = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
_COMPLETIONS = _COMMON | {"prompt", "logprobs", "echo", "suffix"}


def to_batch_record(seq: int, line_no: int, raw: str) -> Record:
    """Parse one non-blank input line (never raises); kwargs = {url, body} of a well-formed line."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return Record(seq, line_no, line_no, None, f"line {line_no} is not valid JSON: {e}", implicit_id=True)
    if not isinstance(obj, dict):
        return Record(seq, line_no, line_no, None,
                      f"line {line_no} is a JSON {type(obj).__name__}, not a batch request object", implicit_id=True)
    if "custom_id" not in obj:
        return Record(seq, line_no, line_no, None, f"line {line_no} has no custom_id", implicit_id=True)
    cid = obj["custom_id"]
    if not isinstance(cid, str) or not cid:
        return Record(seq, line_no, line_no, None,
                      f"line {line_no}: custom_id must be a non-empty string, got {cid!r}", implicit_id=True)
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    err = None
    if method != "POST":
        err = f"method must be 'POST', got {method!r}"
    elif url not in URLS:
        err = f"unknown url {url!r} (supported: {', '.join(URLS)})"
    elif not isinstance(body, dict):
        err = f"body must be a JSON object, got {type(body).__name__}"
    if err:
        return Record(seq, line_no, cid, None, f"line {line_no} (custom_id {cid!r}): {err}")
    return Record(seq, line_no, cid, {"url": url, "body": body})


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int:
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BatchRequestError(f"body.{name} must be an integer {rng}, got {v!r}")
    return v


def _messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BatchRequestError("body.messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BatchRequestError(f"body.messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts are supported
            texts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise BatchRequestError(f"body.messages[{i}].content: only text parts are supported")
                texts.append(p["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise BatchRequestError(f"body.messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


def _prompts(body: dict) -> list[Any]:
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [list(p)]  # one prompt as token ids
        if all(isinstance(x, str) for x in p) or all(
                isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
            return list(p)
    raise BatchRequestError("body.prompt must be a string, a list of strings, or token ids")


def _constraint(body: dict) -> dict[str, Any]:
    rf = body.get("response_format")
    if rf is None:
        return {}
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BatchRequestError("response_format.json_schema must be an object with a 'schema' object")
        return {"json_schema": spec["schema"]}
    raise BatchRequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def choices_per_prompt(body: dict) -> int:
    """`n` of a body that engine_requests accepted."""
    return body["n"] if body.get("n") is not None else 1


def choice_seeds(body: dict, custom_id: str, n: int, job_seed: int | None) -> list[int]:
    if body.get("seed") is not None:
        base = _int(body, "seed", -(2 ** 63))
    else:
        base = zlib.crc32(f"{job_seed or 0}:{id_key(custom_id)}".encode())
    return [(base + i) & 0x7FFFFFFF for i in range(n)]


def engine_requests(url: str, body: dict, custom_id: str, job_seed: int | None = None,
                    defaults: dict[str, Any] | None = None) -> list[tuple[Any, SamplingParams]]:
    """(prompt, params) per choice: for completions with several prompts, prompt-major
    (choice index = prompt index * n + i), as OpenAI numbers them. Raises BatchRequestError."""
    allowed = _CHAT if url == CHAT_URL else _COMPLETIONS
    unknown = sorted(k for k in body if k not in allowed and k not in _IGNORED)
    if unknown:
        raise BatchRequestError(f"unsupported body field(s) for {url}: {', '.join(unknown)}")
    if body.get("stream"):
        raise BatchRequestError("stream is not supported in a batch")
    kw: dict[str, Any] = dict(defaults or {})
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            kw[name] = body[name]
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        if body.get(name) is not None:
            kw["max_tokens"] = _int(body, name, 1)
            break
    if body.get("stop") is not None:
        stop = body["stop"]
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
            raise BatchRequestError(f"body.stop must be a string or a list of strings, got {stop!r}")
        kw["stop"] = stop
    kw.update(_constraint(body))
    n = _int(body, "n", 1, 128) if body.get("n") is not None else 1
    if url == CHAT_URL:
        prompts: list[Any] = [_messages(body)]
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise BatchRequestError("body.top_logprobs needs body.logprobs = true")
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise BatchRequestError(f"body.logprobs must be true or false, got {body['logprobs']!r}")
        if body.get("logprobs"):
            kw["logprobs"] = _int(body, "top_logprobs", 0, 20) if body.get("top_logprobs") is not None else 0
    else:
        prompts = _prompts(body)
        if body.get("echo"):
            raise BatchRequestError("body.echo is not supported")
        if body.get("suffix") is not None:
            raise BatchRequestError("body.suffix is not supported")
        if body.get("logprobs") is not None:
            kw["logprobs"] = _int(body, "logprobs", 0, 20)
    seeds = choice_seeds(body, custom_id, n, job_seed)
    out = []
    for prompt in prompts:
        for seed in seeds:
            try:
                out.append((prompt, SamplingParams(**kw, seed=seed)))
            except (InvalidRequestError, TypeError, ValueError) as e:
                raise BatchRequestError(f"body: {e}") from e
    return out
