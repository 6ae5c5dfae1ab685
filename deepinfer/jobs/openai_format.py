"""Engine outputs -> OpenAI batch output lines.

A line is `{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null,
"error": {"code", "message"} | null}`. The body of a 200 is a `chat.completion` or
`text_completion` object (choices, usage); a request the engine refused has a 400 (500 for an
engine failure) with an OpenAI error body; a line that is no request at all (bad JSON, no
custom_id, unknown url) has `response: null` and `error`. `id` and `request_id` are derived
from the record's key, so a re-run writes the same ids and --resume matches lines by `id`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

from deepinfer.engine.outputs import RequestOutput, TokenLogprob
from deepinfer.errors import InvalidRequestError
from deepinfer.jobs.openai_batch import CHAT_URL
from deepinfer.jobs.records import Record


def batch_line_id(key: str) -> str:
    """The output line's `id` for a record key (stable across runs)."""
    return "batch_req_" + hashlib.sha256(key.encode()).hexdigest()[:24]


def line_key(obj: dict[str, Any]) -> str:
    """What --resume matches an output line by (see batch_line_id)."""
    return obj["id"]


def _line(rec: Record, response: dict | None, error: dict | None) -> dict[str, Any]:
    return {"id": batch_line_id(rec.key), "custom_id": None if rec.implicit_id else rec.id,
            "response": response, "error": error}


def error_line(rec: Record, error: BaseException | str) -> dict[str, Any]:
    """A record that produced no completion: a bad line (`error`) or a refused / failed request
    (`response` with status 400 / 500 and an OpenAI error body)."""
    if isinstance(error, str):  # the line itself is not a request
        return _line(rec, None, {"code": "invalid_request", "message": error})
    client = isinstance(error, InvalidRequestError)
    body = {"error": {"message": f"{type(error).__name__}: {error}",
                      "type": "invalid_request_error" if client else "server_error", "param": None, "code": None}}
    return _line(rec, {"status_code": 400 if client else 500, "request_id": _request_id(rec), "body": body}, None)


def _request_id(rec: Record) -> str:
    return "req_" + hashlib.sha256(("r:" + rec.key).encode()).hexdigest()[:24]


def _finish_reason(out: RequestOutput) -> str:
    return "length" if out.finish_reason == "length" else "stop"


def _chat_logprobs(lps: list[TokenLogprob], tok: Callable[[int], str]) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        t = tok(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {"content": [{**entry(p.token_id, p.logprob), "top_logprobs": [entry(t, l) for t, l in p.top]}
                        for p in lps]}


def _completion_logprobs(lps: list[TokenLogprob], tok: Callable[[int], str]) -> dict[str, Any]:
    tokens = [tok(p.token_id) for p in lps]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [p.logprob for p in lps],
            "top_logprobs": [{tok(t): l for t, l in p.top} for p in lps], "text_offset": offsets}


def completion_line(rec: Record, url: str, outs: list[RequestOutput], n: int, model: str,
                    tok: Callable[[int], str]) -> dict[str, Any]:
    """The 200 line of a finished request (outs: one per choice, prompt-major, n per prompt)."""
    chat = url == CHAT_URL
    choices = []
    for i, out in enumerate(outs):
        c: dict[str, Any] = {"index": i}
        if chat:
            c["message"] = {"role": "assistant", "content": out.text}
            c["logprobs"] = _chat_logprobs(out.logprobs, tok) if out.logprobs is not None else None
        else:
            c["text"] = out.text
            c["logprobs"] = _completion_logprobs(out.logprobs, tok) if out.logprobs is not None else None
        c["finish_reason"] = _finish_reason(out)
        choices.append(c)
    # each prompt is counted once, not once per choice (outs are prompt-major, n per prompt)
    prompt_tokens = sum(len(outs[j].prompt_token_ids) for j in range(0, len(outs), n))
    completion_tokens = sum(len(o.token_ids) for o in outs)
    rid = _request_id(rec)
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + rid[4:], "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return _line(rec, {"status_code": 200, "request_id": rid, "body": body}, None)
