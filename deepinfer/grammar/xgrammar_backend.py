"""xgrammar backend: JSON schemas, EBNF, regex and choices (the default chain's first for regex, EBNF and
choices, and where llguidance refuses or approximates a schema; see compiler.AUTO_ORDER)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import threading

import numpy as np
import torch
import xgrammar as xgr

from deepinfer.errors import GrammarError
from deepinfer.grammar.backend import MAX_JUMP_FORWARD_BYTES, CompiledGrammar, GrammarBackend, GrammarMatcher
from deepinfer.grammar.bitmask import allocate_token_bitmask
from deepinfer.grammar.spec import GrammarSpec
from deepinfer.grammar.vocab import VOCAB_BYTE_FALLBACK, VOCAB_BYTE_LEVEL, TokenizerVocab
from deepinfer.grammar.ws_guard import WhitespaceGuard, WhitespaceTables
from deepinfer_kernels import bitmask as native_bitmask

_VOCAB_TYPES = {VOCAB_BYTE_LEVEL: xgr.VocabType.BYTE_LEVEL, VOCAB_BYTE_FALLBACK: xgr.VocabType.BYTE_FALLBACK}

# Whitespace between JSON elements is free (any JSON whitespace) but bounded to
# MAX_JSON_WHITESPACE bytes per gap, so a sampled model cannot spin on newlines forever. The bound
# is kept by ws_guard.py around the matcher, not by xgrammar's max_whitespace_cnt: that count made
# its mask fills 3-4x slower (p99 229 -> 58 us per fill without it, JSONSchemaBench subsets).
_PROBLEM = {"regex": "invalid regex", "json_schema": "invalid JSON schema", "json_object": "invalid JSON schema",
            "ebnf": "invalid EBNF", "choices": "invalid choices"}


# xgrammar's C++ warnings ("[time] file.cc:line: Warning: ...") go straight to fd 2. They say
# which keywords it approximated, so we capture them per compile instead of flooding stderr.
_WARNING_RE = re.compile(r"^\[[^\]]*\] [^ ]+\.cc:\d+: Warning: (.*)$")
_FD2_LOCK = threading.Lock()  # fd 2 is process-wide: one capture at a time


@contextlib.contextmanager
def captured_warnings(out: list[str]):
    """Collect xgrammar's warnings written to fd 2 inside the block into out; any other line
    written meanwhile (another thread's output) is passed on to stderr afterwards."""
    with _FD2_LOCK, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            other = []
            for line in tmp.read().decode("utf-8", errors="replace").splitlines():
                m = _WARNING_RE.match(line)
                if m:
                    out.append(m.group(1))
                elif line:
                    other.append(line)
            if other:
                print("\n".join(other), file=sys.stderr)


def _ebnf_literal(s: str) -> str:
    """A double-quoted EBNF string literal matching exactly s."""
    out = []
    for ch in s:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choices_ebnf(choices: list[str]) -> str:
    """An EBNF grammar over exactly the given strings."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


_NOT_SCHEMAS = frozenset({"properties", "patternProperties", "const", "enum", "default", "examples"})


def drop_false_properties(schema, dropped: list[tuple[str, bool]] | None = None):
    """A copy of schema without optional properties whose schema is `false` (the key may not
    appear; (name, whether the object states additionalProperties) is appended to dropped), and
    with `false` pattern-property schemas written `{"not": {}}` (the same schema, which xgrammar
    compiles without enforcing it: reported through dropped too). xgrammar rejects `false` outright ("Schema 'false' cannot accept any value").
    Dropping is exact under strict mode or additionalProperties: false; otherwise the key becomes
    an ordinary additional property (an over-approximation the backend reports as a warning)."""
    if isinstance(schema, list):
        return [drop_false_properties(x, dropped) for x in schema]
    if not isinstance(schema, dict):
        return schema
    # values (const, enum, ...) are data, not schemas; the two property maps are handled below
    # (visiting them here too doubled the work per nesting level)
    out = {k: v if k in _NOT_SCHEMAS else drop_false_properties(v, dropped) for k, v in schema.items()}
    props = schema.get("properties")
    if isinstance(props, dict):
        required = set(schema.get("required") or [])
        out["properties"] = {}
        for k, v in props.items():
            if v is False and k not in required:
                ap = schema.get("additionalProperties")
                if dropped is not None and ap is not False:  # (key, additional keys allowed even in strict mode)
                    dropped.append((k, ap is not None))
                continue
            out["properties"][k] = drop_false_properties(v, dropped)
    pats = schema.get("patternProperties")
    if isinstance(pats, dict):
        out["patternProperties"] = {k: {"not": {}} if v is False else drop_false_properties(v, dropped)
                                    for k, v in pats.items()}
        if dropped is not None:  # xgrammar does not enforce `not`: keys matching these are allowed
            dropped.extend((f"/{k}/", True) for k, v in pats.items() if v is False)
    return out


def first_byte_table(token_bytes: list[bytes | None]) -> np.ndarray:
    """First byte of each token id (-1: special or empty), for the forced-byte probe."""
    return np.array([b[0] if b else -1 for b in token_bytes], dtype=np.int16)


def _next_bytes_forced(bitmask: torch.Tensor, first_byte: np.ndarray) -> int | None:
    """The one byte every allowed token starts with, or None when zero or several bytes can follow.
    Natively where it can (kernels/csrc/bitmask.c: a bit walk that stops at the second distinct byte);
    else numpy over the non-zero words (~170 us per call on a 49k vocab; torch's bit unpacking ~40 ms)."""
    b = native_bitmask.forced_byte(bitmask[0], first_byte)
    if b is not False:
        return b
    words = bitmask[0].numpy()
    nz = np.flatnonzero(words)
    # bit i of word w is token 32 w + i (a little-endian view of the int32 words as bytes)
    bits = np.unpackbits(words[nz].view(np.uint8), bitorder="little").reshape(len(nz), 32).astype(bool)
    ids = (nz[:, None] * 32 + np.arange(32))[bits]
    fb = first_byte[ids[ids < len(first_byte)]]
    fb = fb[fb >= 0]
    if fb.size == 0:
        return None
    lo, hi = int(fb.min()), int(fb.max())
    return lo if lo == hi else None


def _complete_utf8(out: bytes) -> str:
    """The forced bytes as text: nothing when they start inside a character, and an unfinished
    last character dropped (its bytes become forced again once the model writes them)."""
    if out and 0x80 <= out[0] < 0xC0:
        return ""
    for cut in range(4):
        try:
            return out[: len(out) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


class XGrammarMatcher(GrammarMatcher):
    """Thin wrapper over xgrammar.GrammarMatcher (plus the whitespace bound of JSON grammars)."""

    supports_rollback = True

    def __init__(self, compiled: xgr.CompiledGrammar, first_byte: np.ndarray | None = None,
                 ws_tables: WhitespaceTables | None = None):
        self._m = xgr.GrammarMatcher(compiled)
        self._first_byte = first_byte
        self._ws = WhitespaceGuard(ws_tables) if ws_tables is not None else None
        self._n_tokens = len(ws_tables.token_bytes) if ws_tables is not None else 0

    def accept_token(self, token_id: int) -> bool:
        t = int(token_id)
        ws = self._ws
        if ws is None:
            return bool(self._m.accept_token(t))
        if ws.over(t) and self._ws_refuses(t):
            return False
        if not self._m.accept_token(t):
            return False
        ws.push(t)
        return True

    def _ws_refuses(self, t: int) -> bool:
        """Whether the mask (with the whitespace bound) leaves t out: the same rule fill_bitmask applies."""
        mask = allocate_token_bitmask(1, self._n_tokens)
        self.fill_bitmask(mask, 0)
        return not (int(mask[0, t // 32]) >> (t % 32)) & 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._ws is not None and not self._ws.restrict(bitmask, row):
            self._m.fill_next_token_bitmask(bitmask, row)  # never an empty row: drop the bound

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def can_terminate(self) -> bool:
        return bool(self._m.is_completed())

    def find_jump_forward_string(self, max_bytes: int = MAX_JUMP_FORWARD_BYTES) -> str:
        """Bounded: xgrammar's own find_jump_forward_string builds the whole forced string first,
        and a grammar such as `a ::= "x" a` forces an endless one (std::bad_alloc after GBs).
        So the forced bytes are probed one at a time on a fork of the matcher, at most max_bytes."""
        if self._first_byte is None:  # no vocabulary table: nothing can be proved forced
            return ""
        try:
            return self._probe_forced(max_bytes)
        except (RuntimeError, ValueError, MemoryError):  # "nothing forced" is always a safe answer
            return ""

    def _probe_forced(self, max_bytes: int) -> str:
        cur, out = self._m, bytearray()
        mask = allocate_token_bitmask(1, len(self._first_byte))
        while len(out) < max_bytes and not cur.is_terminated() and not cur.is_completed():
            cur.fill_next_token_bitmask(mask, 0)
            b = _next_bytes_forced(mask, self._first_byte)
            if b is None:
                break
            if cur is self._m:
                cur = self._m.fork()  # the probe must not move the request's own matcher
            if not cur.accept_string(bytes([b])):
                break
            out.append(b)
        return _complete_utf8(bytes(out))

    def rollback(self, n: int) -> None:
        self._m.rollback(int(n))
        if self._ws is not None:
            self._ws.pop(int(n))

    def reset(self) -> None:
        self._m.reset()
        if self._ws is not None:
            self._ws.reset()


class XGrammarCompiled(CompiledGrammar):
    backend_name = "xgrammar"

    def __init__(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar, warnings: list[str],
                 first_byte: np.ndarray | None = None, ws_tables: WhitespaceTables | None = None):
        self.spec = spec
        self.compiled = compiled
        self.warnings = warnings
        self.first_byte = first_byte
        self.ws_tables = ws_tables  # JSON grammars: the whitespace bound's tables

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, self.first_byte, self.ws_tables)


class XGrammarBackend(GrammarBackend):
    """Compiles every spec kind with xgrammar for one TokenizerVocab."""

    name = "xgrammar"

    def __init__(self, vocab: TokenizerVocab, max_threads: int = 2, strict_json: bool = True):
        """strict_json: schemas forbid properties/items they do not declare (xgrammar's default
        strict mode). Measured ~50x faster to compile than JSON Schema's default semantics
        (additional properties allowed, which needs an any-JSON sub-grammar) and keeps models on
        the declared fields; its outputs always validate, but instances with undeclared extra
        properties are rejected. json_object mode is never strict (it means any object)."""
        self.strict_json = strict_json
        self.first_byte = first_byte_table(vocab.token_bytes)
        self._vocab = vocab
        self._ws_tables: WhitespaceTables | None = None  # made at the first JSON spec
        info = xgr.TokenizerInfo(
            vocab.encoded,
            _VOCAB_TYPES.get(vocab.vocab_type, xgr.VocabType.RAW),
            vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.stop_token_ids),
            add_prefix_space=vocab.add_prefix_space,
        )
        self.tokenizer_info = info  # what a grammar compiled in the worker process deserialises against (isolated.py)
        # xgrammar's own cache is off: GrammarCompiler caches compiled specs itself.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> XGrammarCompiled:
        warnings: list[str] = []
        mode: dict[str, bool] = {}
        try:
            with captured_warnings(warnings):
                cg = self._compile(spec, warnings, mode)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with a parser message
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            # drop xgrammar's "[time] file.cc:line: " prefix, keep the parser's message
            msg = msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg
            raise GrammarError(f"{_PROBLEM.get(spec.kind, 'invalid grammar')} (xgrammar): {msg}") from e
        ws = self.ws_tables() if spec.kind in ("json_schema", "json_object") else None
        out = XGrammarCompiled(spec, cg, list(dict.fromkeys(warnings)), self.first_byte, ws)
        out.strict = mode.get("strict", False)
        return out

    def ws_tables(self) -> WhitespaceTables:
        """The whitespace bound's tables for this vocabulary (made once; a race makes two, harmlessly)."""
        if self._ws_tables is None:
            self._ws_tables = WhitespaceTables(self._vocab.token_bytes, (self._vocab.vocab_size + 31) // 32)
        return self._ws_tables

    def _compile(self, spec: GrammarSpec, warnings: list[str], mode: dict[str, bool]) -> xgr.CompiledGrammar:
        if spec.kind in ("json_schema", "json_object"):
            return self._compile_schema(spec, warnings, mode)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return self._compiler.compile_grammar(spec.text)
        if spec.kind == "choices":
            return self._compiler.compile_grammar(choices_ebnf(json.loads(spec.text)))
        raise GrammarError(f"xgrammar: unsupported grammar kind {spec.kind!r}")  # new kinds

    def _compile_schema(self, spec: GrammarSpec, warnings: list[str], mode: dict[str, bool]) -> xgr.CompiledGrammar:
        text = spec.text
        dropped: list[str] = []
        if "roperties" in text and "false" in text:
            text = json.dumps(drop_false_properties(json.loads(text), dropped), ensure_ascii=False)
        strict = self.strict_json and spec.kind == "json_schema"
        try:
            cg = self._compiler.compile_json_schema(
                text, any_whitespace=True, strict_mode=strict, max_whitespace_cnt=None
            )
        except Exception:
            if not strict:
                raise
            # strict mode can make a schema unsatisfiable (e.g. minProperties above the declared
            # properties): such a schema needs its undeclared properties, so compile it non-strict
            strict = False
            cg = self._compiler.compile_json_schema(
                text, any_whitespace=True, strict_mode=False, max_whitespace_cnt=None
            )
        loose = sorted({k for k, explicit in dropped if explicit or not strict})
        if loose:  # these forbidden keys became ordinary additional properties
            warnings.append(f"false property schemas not enforced (keys allowed): {loose}")
        mode["strict"] = strict
        return cg
