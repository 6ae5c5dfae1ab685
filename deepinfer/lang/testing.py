"""An instant, deterministic stand-in for the engine, for testing and benchmarking programs.

`FakeEngine` implements the step-level API the runtime uses (tokenizer, add_request, step, abort,
has_unfinished, generate) without a model: outputs are scripted by a `respond(prompt_text,
params)` callback or made up (first choice / canned constraint value / a JSON instance of the
schema / pseudo-words), and honour max_tokens, stop strings, stop_token_ids and EOS like a real
engine (token_ids include the tokens of a stop string and the EOS; text does not). Logprobs come
from `logprob_fn(context_ids, token_id)`. It records every request it sees.

`FakeTokenizer` is a greedy longest-match tokenizer over bytes + a small word list (so adjacent
text pieces tokenise differently together than apart, as with BPE) + ChatML special tokens, with
a SmolLM2-style chat template (a default system prompt when the chat starts without one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import jinja2

from deepinfer.engine.outputs import RequestOutput, TokenLogprob
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import GrammarError, InvalidRequestError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = (
    "the", "a", "is", "of", "and", "to", "in", "it", "Paris", "London", "Berlin", "France", "capital",
    "answer", "Answer", "question", "Question", "Hello", "hello", "world", "user", "assistant",
    "system", "You", "you", "are", "helpful", "name", "age", "tool", "search", "result", "Thought",
    "Action", "Observation", "Finish", "yes", "no", "true", "false", "ing", "ed", "er", "Q:", "A:",
    "city", "number", "Alice", "Bob", "fact", "facts", "text", "extract", "sure", "Here",
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class FakeTokenizer:
    """Deterministic tokenizer with the engine Tokenizer's interface (see module docstring)."""

    def __init__(self, chat_template: str | None = CHATML_TEMPLATE, add_bos: bool = False) -> None:
        self._id_to_bytes: list[bytes] = [bytes([b]) for b in range(256)]
        self._word_ids: dict[str, int] = {}
        for w in WORDS:
            for piece in (w, " " + w):
                if piece not in self._word_ids:
                    self._word_ids[piece] = len(self._id_to_bytes)
                    self._id_to_bytes.append(piece.encode())
        # leftmost alternation with longer words first == greedy longest match
        words = sorted(self._word_ids, key=len, reverse=True)
        self._piece_re = re.compile("|".join(re.escape(w) for w in words) + "|.", re.DOTALL)
        self.special_ids: dict[str, int] = {}
        for s in SPECIAL_TOKENS:
            self.special_ids[s] = len(self._id_to_bytes)
            self._id_to_bytes.append(s.encode())
        self.special_token_ids: set[int] = set(self.special_ids.values())  # as the engine's Tokenizer
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
        self.vocab_size = len(self._id_to_bytes)
        self.bos_token = "<|endoftext|>"
        self.bos_token_id = self.special_ids["<|endoftext|>"]
        self.eos_token_ids = [self.special_ids["<|im_end|>"], self.special_ids["<|endoftext|>"]]
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template = jinja2.Environment().from_string(chat_template) if chat_template else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = [self.bos_token_id] if add_special_tokens and self.add_bos else []
        for part in self._special_re.split(text):
            if not part:
                continue
            if part in self.special_ids:
                ids.append(self.special_ids[part])
                continue
            for piece in self._piece_re.findall(part):
                wid = self._word_ids.get(piece)
                if wid is not None:
                    ids.append(wid)
                else:
                    ids.extend(piece.encode())
        return ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        special = set(self.special_ids.values())
        out = b"".join(
            self._id_to_bytes[i] for i in ids if not (skip_special_tokens and i in special)
        )
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        if self._template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template; pass a plain prompt instead")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, **kw)


def default_logprob(context: list[int], token: int) -> float:
    """A deterministic pseudo logprob in (-5, -0.01]."""
    return -((hash((tuple(context[-3:]), token)) % 1000) / 200.0) - 0.01


_CANNED_DTYPE = {"int": "42", "float": "3.5", "bool": "true", "str": '"fake"'}
_REGEX_CANDIDATES = ("42", "Paris", "yes", "no", "true", "Alice", "3.5", "abc", "2024-01-01", "x", "A", "1")


def example_from_schema(schema: Any, defs: dict[str, Any] | None = None) -> Any:
    """A small JSON instance of a JSON schema (enough for tests; not a validator)."""
    if not isinstance(schema, dict):
        return None
    defs = defs if defs is not None else {**schema.get("$defs", {}), **schema.get("definitions", {})}
    if "$ref" in schema:
        return example_from_schema(defs.get(schema["$ref"].rsplit("/", 1)[-1], {}), defs)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return example_from_schema(schema[key][0], defs)
    t = schema.get("type")
    if isinstance(t, list):
        t = t[0]
    if t == "object" or "properties" in schema:
        return {k: example_from_schema(v, defs) for k, v in schema.get("properties", {}).items()}
    if t == "array":
        return [example_from_schema(schema.get("items", {"type": "integer"}), defs)]
    return {"string": "fake", "integer": 7, "number": 1.5, "boolean": True, "null": None}.get(t, "fake")


def _schema_dict(json_schema: Any) -> dict:
    import json

    from deepinfer.grammar.spec import schema_from_type

    if isinstance(json_schema, str):
        try:
            return json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid JSON schema: the string is not valid JSON ({e})") from e
    if isinstance(json_schema, dict):
        return json_schema
    return schema_from_type(json_schema)


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    ids: list[int]
    text: str
    finish_reason: str
    stop_reason: Any
    cached: int
    emitted: int = 0
    out: RequestOutput | None = None


@dataclass
class FakeEngine:
    """Instant engine double; see the module docstring. `log` holds (request_id, prompt_ids, params)."""

    tokenizer: Any = None
    respond: Callable[[str, SamplingParams], str | None] | None = None
    logprob_fn: Callable[[list[int], int], float] = default_logprob
    tokens_per_step: int = 4
    default_tokens: int = 8
    cache_block: int = 4
    byte_level_output: bool = False  # emit output text as one token per byte (non-canonical ids)
    log: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    max_running: int = 0
    num_steps: int = 0
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = FakeTokenizer()
        self._running: dict[str, _Request] = {}
        self._cache: set[int] = set()
        self._next = 0

    # ---------------------------------------------------------------- planning
    def _plan_text(self, prompt: list[int], params: SamplingParams) -> str:
        if self.respond is not None:
            text = self.respond(self.tokenizer.decode(prompt, skip_special_tokens=False), params)
            if text is not None:
                return text
        if params.choices:
            return params.choices[0]
        if params.dtype is not None:
            name = params.dtype if isinstance(params.dtype, str) else params.dtype.__name__
            return _CANNED_DTYPE.get(name, "fake")
        if params.regex is not None:
            return next((c for c in _REGEX_CANDIDATES if re.fullmatch(params.regex, c)), "")
        if params.json_schema is not None or params.json_object:
            import json

            schema = _schema_dict(params.json_schema) if params.json_schema is not None else {"type": "object"}
            return json.dumps(example_from_schema(schema))
        h = hash((tuple(prompt[-8:]), params.seed or 0))  # hash(None) varies per process before 3.12
        return " ".join(WORDS[(h >> (3 * k)) % len(WORDS)] for k in range(self.default_tokens))

    def _validate(self, prompt: Any, params: Any) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if any(not isinstance(i, int) or not 0 <= i < self.tokenizer.vocab_size for i in ids):
            raise InvalidRequestError("prompt token id outside the vocabulary")
        if params.regex is not None:
            try:
                re.compile(params.regex)
            except re.error as e:
                raise GrammarError(f"invalid regex {params.regex!r}: {e}") from e
        if params.json_schema is not None:
            schema = _schema_dict(params.json_schema)
            if not isinstance(schema, dict) or schema.get("type") not in (None, "object", "array", "string",
                                                                         "integer", "number", "boolean", "null"):
                raise GrammarError(f"invalid JSON schema: {schema!r}")
        return ids

    def _cached_len(self, ids: list[int]) -> int:
        h, n, b = 0, 0, self.cache_block
        for start in range(0, len(ids) - b + 1, b):
            h = hash((h, tuple(ids[start:start + b])))
            if h not in self._cache:
                break
            n = start + b
        return n

    def _insert_cache(self, ids: list[int]) -> None:
        h, b = 0, self.cache_block
        for start in range(0, len(ids) - b + 1, b):
            h = hash((h, tuple(ids[start:start + b])))
            self._cache.add(h)

    # ---------------------------------------------------------------- step-level API
    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue one request (InvalidRequestError / GrammarError on bad input)."""
        ids = self._validate(prompt, params)
        rid = request_id or f"fake-{self._next}"
        self._next += 1
        if rid in self._running:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        tok = self.tokenizer
        eos = tok.eos_token_ids[0]
        encode = tok.encode
        if self.byte_level_output:
            def encode(text: str) -> list[int]:
                return list(text.encode())

        if params.max_tokens == 0:
            out_ids, text, reason, stop_reason = [], "", "length", None
        else:
            full = self._plan_text(ids, params)
            hits = [(full.find(s), s) for s in params.stop if s in full]
            if hits:
                at, s = min(hits)
                out_ids = encode(full[: at + len(s)])
                text = full[: at + len(s)] if params.include_stop_str_in_output else full[:at]
                reason, stop_reason = "stop", s
            else:
                out_ids, text, reason, stop_reason = encode(full) + [eos], full, "stop", eos
            for j, t in enumerate(out_ids):
                if t in params.stop_token_ids:
                    out_ids, text, reason, stop_reason = out_ids[: j + 1], tok.decode(out_ids[:j]), "stop", t
                    break
            if len(out_ids) > params.max_tokens:
                out_ids = out_ids[: params.max_tokens]
                text, reason, stop_reason = tok.decode(out_ids), "length", None
        req = _Request(rid, ids, params, out_ids, text, reason, stop_reason, self._cached_len(ids))
        self._running[rid] = req
        self.log.append((rid, ids, params))
        self.max_running = max(self.max_running, len(self._running))
        return rid

    def step(self) -> list[RequestOutput]:
        """Advance every request by up to tokens_per_step tokens; one output per request."""
        self.num_steps += 1
        outs = []
        for rid, r in list(self._running.items()):
            if r.out is None:
                r.out = RequestOutput(rid, r.prompt, num_cached_tokens=r.cached)
                if r.params.prompt_logprobs is not None:
                    # like the engine: positions before prompt_logprobs_start may come from the cache
                    start = getattr(r.params, "prompt_logprobs_start", 0)
                    r.out.prompt_logprobs = [
                        TokenLogprob(t, self.logprob_fn(r.prompt[:i], t)) if i and i >= start else None
                        for i, t in enumerate(r.prompt)
                    ]
                if r.params.logprobs is not None:
                    r.out.logprobs = []
            k = min(len(r.ids), r.emitted + self.tokens_per_step)
            new = r.ids[r.emitted:k]
            if r.out.logprobs is not None:
                ctx = r.prompt + r.ids[: r.emitted]
                for t in new:
                    r.out.logprobs.append(TokenLogprob(t, self.logprob_fn(ctx, t)))
                    ctx = ctx + [t]
            r.emitted = k
            done = k >= len(r.ids)
            text = r.text if done else r.text[: len(self.tokenizer.decode(r.ids[:k]))]
            out = RequestOutput(
                rid, r.prompt, token_ids=list(r.ids[:k]), text=text, delta_token_ids=list(new),
                delta_text=text[len(r.out.text):], finished=done,
                finish_reason=r.finish_reason if done else None,
                stop_reason=r.stop_reason if done else None,
                logprobs=list(r.out.logprobs) if r.out.logprobs is not None else None,
                prompt_logprobs=r.out.prompt_logprobs, num_cached_tokens=r.cached,
                grammar_backend="fake" if r.params.constrained else None,
            )
            if done and r.params.constrained:
                out.valid, out.violation = _fake_validation(r.params, text, out.finish_reason)
            r.out = out
            outs.append(out)
            if done:
                del self._running[rid]
                self._insert_cache(r.prompt + r.ids)
        return outs

    def abort(self, request_id: str) -> None:
        if self._running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def generate(self, prompts: Any, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        rids = [self.add_request(p, params or SamplingParams()) for p in plist]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(rids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r] for r in rids]


def _fake_validation(params: Any, text: str, finish_reason: str | None) -> tuple[bool | None, str | None]:
    """Like the engine's validation at finish for a grammar that enforces nothing (the fake's
    responses are not constrained): JSON-schema outputs are checked, other kinds are not."""
    from deepinfer.grammar.spec import spec_of
    from deepinfer.grammar.validate import first_violation

    spec = spec_of(params)
    if spec is None or spec.kind not in ("json_schema", "json_object") or finish_reason not in ("stop", "length"):
        return None, None
    why = first_violation(spec.text, text)
    return why is None, why
