"""llguidance backend: JSON schemas, regex, EBNF (via Lark) and choices.

llguidance refuses JSON-schema keywords it does not implement (its non-lenient mode), so what it
compiles it enforces; its own warnings are kept as diagnostics. It builds its lexer and masks
lazily, so a schema's first mask comes in milliseconds (the default chain's first backend for
schemas, see compiler.AUTO_ORDER); strict mode is a schema rewrite (strict.py). A matcher that
consumes a token the grammar forbids enters a permanent error state, so `accept_token` checks the
token first to keep our contract (False and state unchanged).
"""

from __future__ import annotations

import json

import llguidance as llg
import numpy as np
import llguidance.torch as llg_torch
import torch
# the converter function, not `llg.gbnf_to_lark`: that name is the submodule (llguidance 1.x
# does not re-export the function), and calling it fails with "'module' object is not callable"
from llguidance.gbnf_to_lark import gbnf_to_lark

from deepinfer.errors import GrammarError, InvalidSpecError
from deepinfer.grammar.backend import MAX_JUMP_FORWARD_BYTES, CompiledGrammar, GrammarBackend, GrammarMatcher
from deepinfer.grammar.spec import GrammarSpec
from deepinfer.grammar.strict import strict_schema
from deepinfer.grammar.vocab import TokenizerVocab

# Bounded whitespace between JSON elements, as for xgrammar: a sampled model cannot spin on
# newlines forever, and 16 still fits indented output.
_JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
_PROBLEM = {"regex": "invalid regex", "json_schema": "invalid JSON schema", "json_object": "invalid JSON schema",
            "ebnf": "invalid EBNF", "choices": "invalid choices"}


def _first_line(msg: str) -> str:
    """The message of a llguidance error, without the parser state and grammar it appends (its
    whole 1.3 MB grammar text on issue 51's schema)."""
    return (msg or "").strip().split("\n<state>", 1)[0].splitlines()[0][:500] if msg else ""


class LLGuidanceMatcher(GrammarMatcher):
    supports_rollback = True

    def __init__(self, cg: "LLGuidanceCompiled"):
        self._cg = cg
        self._m = cg.prototype.deep_copy()
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        t = int(token_id)
        if self._terminated:
            return False
        if t in self._cg.stop_ids:
            if not self._m.is_accepting():
                return False
            self._terminated = True  # the stop token itself is not fed to llguidance
            return True
        if not 0 <= t < self._cg.n_tokens:
            return False
        if self._m.validate_tokens([t]) != 1:
            if self._m.is_error():
                raise GrammarError(f"llguidance: {_first_line(self._m.get_error())}")
            return False
        if not self._m.consume_token(t) or self._m.is_error():
            # a token it validated and cannot consume: a parser limit (on issue 51's 9,000-property
            # schema: "Current row has 36007 items; max is 2000" at the first `{"`), not a refusal:
            # an error naming it, not "grammar rejected sampled token"
            raise GrammarError(f"llguidance: {_first_line(self._m.get_error()) or 'cannot consume a token it validated'}")
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        out = bitmask[row]
        if self._terminated:
            out.zero_()
            return
        llg_torch.fill_next_token_bitmask(self._m, bitmask, row)
        if self._m.is_error():
            # a parser limit hit while computing the mask (e.g. "Current row has 36007 items; max is
            # 2000" on a 9,000-property object): the row is not this grammar's mask, and the matcher
            # refuses every token from here (the source of issue 51's "grammar rejected sampled token")
            out.zero_()
            raise GrammarError(f"llguidance: {_first_line(self._m.get_error())}")
        # stop tokens exactly when the text so far is complete (ours may differ from llguidance's EOS)
        accepting = self._m.is_accepting()
        if out.device.type == "cpu":  # numpy on the row's view: torch indexing took 22 of 42 us per fill
            view = out.numpy()
            for w, b in self._cg.stop_pairs:
                view[w] = (view[w] | b) if accepting else (view[w] & ~b)
            return
        words, bits = self._cg.stop_words, self._cg.stop_bits
        if accepting:
            out[words] |= bits
        else:
            out[words] &= ~bits

    def is_terminated(self) -> bool:
        return self._terminated

    def can_terminate(self) -> bool:
        return not self._terminated and bool(self._m.is_accepting())

    def find_jump_forward_string(self, max_bytes: int = MAX_JUMP_FORWARD_BYTES) -> str:
        if self._terminated or max_bytes <= 0:
            return ""
        return self._m.compute_ff_bytes()[:max_bytes].decode("utf-8", errors="ignore")

    def rollback(self, n: int) -> None:
        n = int(n)
        if n and self._terminated:
            self._terminated = False
            n -= 1
        if n and not self._m.rollback(n):
            raise GrammarError(f"llguidance: cannot roll back {n} tokens: {self._m.get_error()}")

    def reset(self) -> None:
        self._m.reset()
        self._terminated = False


class LLGuidanceCompiled(CompiledGrammar):
    backend_name = "llguidance"

    def __init__(self, spec: GrammarSpec, prototype: "llg.LLMatcher", backend: "LLGuidanceBackend",
                 warnings: list[str]):
        self.spec = spec
        self.prototype = prototype
        self.warnings = warnings
        self.stop_ids = backend.stop_ids
        self.n_tokens = backend.n_tokens
        self.stop_words, self.stop_bits = backend.stop_words, backend.stop_bits
        self.stop_pairs = backend.stop_pairs

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, vocab: TokenizerVocab, strict_json: bool = True):
        """strict_json: schemas forbid the properties and tuple items they do not declare, as
        xgrammar's strict mode does (llguidance has no such mode: strict.py writes it into the
        schema where that only narrows the language). json_object mode is never strict."""
        self.strict_json = strict_json
        if vocab.tokenizer is None:
            raise GrammarError("llguidance needs the tokenizer's definition (TokenizerVocab.from_tokenizer)")
        self.vocab = vocab
        self.stop_ids = frozenset(vocab.stop_token_ids)
        self.n_tokens = vocab.vocab_size
        self.tokenizer = llg.LLTokenizer(vocab.tokenizer.to_str(), n_vocab=vocab.vocab_size,
                                         eos_token=list(vocab.stop_token_ids) or None)
        # stop bits grouped per mask word (one |= / &= per word)
        per_word: dict[int, int] = {}
        for t in vocab.stop_token_ids:
            per_word[t // 32] = per_word.get(t // 32, 0) | (1 << (t % 32))
        self.stop_words = torch.tensor(sorted(per_word), dtype=torch.int64)
        self.stop_bits = torch.tensor(
            [v - (1 << 32) if v >= 1 << 31 else v for _, v in sorted(per_word.items())], dtype=torch.int32
        )
        self.stop_pairs = [(int(w), np.int32(b)) for w, b in zip(self.stop_words.tolist(), self.stop_bits.tolist())]

    def grammar_for(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text for spec."""
        if spec.kind in ("json_schema", "json_object"):
            return llg.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "ebnf":
            return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text))
        if spec.kind == "choices":
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.text))
            return llg.LLMatcher.grammar_from_lark(f"start: {alts}")
        raise GrammarError(f"llguidance: unsupported grammar kind {spec.kind!r}")

    def compile(self, spec: GrammarSpec) -> LLGuidanceCompiled:
        if self.strict_json and spec.kind == "json_schema":
            narrowed_schema, narrowed = strict_schema(json.loads(spec.text))
            if narrowed:
                try:
                    out = self._compile(GrammarSpec(spec.kind, json.dumps(narrowed_schema, ensure_ascii=False)))
                except GrammarError:
                    # the narrowing left no instance somewhere llguidance can tell (e.g. a
                    # minProperties its required keys need): compile the schema as given
                    pass
                else:
                    out.spec = spec
                    out.strict, out.narrowed = True, tuple(narrowed)
                    return out
        return self._compile(spec)

    def _compile(self, spec: GrammarSpec) -> LLGuidanceCompiled:
        try:
            grammar = self.grammar_for(spec)
            is_err, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        except GrammarError:
            raise
        except Exception as e:  # gbnf_to_lark (GbnfToLarkError) / grammar_from_* (ValueError) on malformed input
            raise GrammarError(f"{_PROBLEM.get(spec.kind, 'invalid grammar')} (llguidance): {e}") from e
        if is_err:
            msg = messages[0].strip().splitlines()[0] if messages else "rejected"
            if "Unsatisfiable schema" in msg:  # llguidance proved no instance exists: not a coverage gap
                raise InvalidSpecError(f"unsatisfiable JSON schema (llguidance): {msg}")
            raise GrammarError(f"{_PROBLEM.get(spec.kind, 'invalid grammar')} (llguidance): {msg}")
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"{_PROBLEM.get(spec.kind, 'invalid grammar')} (llguidance): {m.get_error()}")
        return LLGuidanceCompiled(spec, m, self, list(messages))
