"""outlines-core backend: regex, choices, and JSON schemas via outlines' schema-to-regex.

Guard against an outlines-core fault: its Index drops the transitions *out of* accepting states
(with `[0-9]+(\\.[0-9]+)?` the token "." is missing after "9"; with `a|aa` no second "a"). We
never let the user's regex R own an accepting state: we compile `(?:R)` followed by an end
marker character M, and give M a private token id (`marker_id`, beyond the model's vocabulary).
Every state of R is then non-accepting, so no transition is dropped; "R could end here" becomes
"M leads from here into a final state", which is when we allow the stop tokens. Real tokens that
only live because they spell (part of) M are masked: one landing in a final state, or one ending
in a prefix of M's bytes after which nothing but the rest of M may follow (byte-level vocabularies
hold every single byte). So M never leaks into output unless R itself allows U+10FFFD there.
The Vocabulary's EOS is another private id: stop tokens are handled by the matcher.
"""

from __future__ import annotations

import json
import re

import outlines_core as oc
import torch

from deepinfer.errors import GrammarError, InvalidSpecError
from deepinfer.grammar.backend import MAX_JUMP_FORWARD_BYTES, CompiledGrammar, GrammarBackend, GrammarMatcher
from deepinfer.grammar.spec import GrammarSpec
from deepinfer.grammar.vocab import TokenizerVocab

_MARKER_CANDIDATES = ("\U0010fffd", "\U0010fffc", "\U0010fffb", "\U000ffffd")
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
# outlines builds a DFA over bytes: a bounded repetition {m,n} copies its body n times, so a
# schema's maxLength 5000 takes minutes and GBs. Refuse large bounds instead (xgrammar's
# pushdown automaton has no such cost). Other blowups remain possible (e.g. Unicode classes
# such as \s inside repeated URI patterns): outlines is the fallback, not the default.
MAX_REPEAT = 256
_REPEAT_RE = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def regex_escape(s: str) -> str:
    """Escape s for the Rust regex syntax outlines-core uses (literal match)."""
    out = []
    for ch in s:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return "".join(out)


class OutlinesMatcher(GrammarMatcher):
    """Matcher over an outlines Index with the end-marker guard."""

    supports_rollback = True

    def __init__(self, cg: "OutlinesCompiled"):
        self._cg = cg
        self.reset()

    def reset(self) -> None:
        self._states = [self._cg.index.get_initial_state()]  # stack: rollback pops it
        self._terminated = False

    @property
    def _state(self) -> int:
        return self._states[-1]

    def can_terminate(self) -> bool:
        return self._cg.ends_here(self._state)

    def is_terminated(self) -> bool:
        return self._terminated

    def accept_token(self, token_id: int) -> bool:
        t = int(token_id)
        if self._terminated:
            return False
        if t in self._cg.stop_ids:
            if not self.can_terminate():
                return False
            self._terminated = True
            self._states.append(self._state)
            return True
        if t >= self._cg.vocab_size:
            return False
        if not self._cg.is_allowed(self._state, t):
            return False
        self._states.append(self._cg.index.get_next_state(self._state, t))
        return True

    def rollback(self, n: int) -> None:
        n = int(n)
        if n < 0 or n >= len(self._states):
            raise GrammarError(f"cannot roll back {n} tokens: only {len(self._states) - 1} accepted")
        if n:
            del self._states[-n:]
            self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        cg = self._cg
        if bitmask.shape[1] < cg.words:
            raise GrammarError(f"bitmask has {bitmask.shape[1]} words, too few for vocab {cg.vocab_size}")
        out = bitmask[row]
        out.zero_()
        if self._terminated:
            return
        out[: cg.words].copy_(cg.allowed_words(self._state))
        if self.can_terminate():
            _set_bits(out, cg.stop_tensor)

    def find_jump_forward_string(self, max_bytes: int = MAX_JUMP_FORWARD_BYTES) -> str:
        """Follow states while exactly one next byte is possible (and R cannot end there)."""
        cg = self._cg
        state, out = self._state, bytearray()
        if self._terminated:
            return ""
        while len(out) < max_bytes:
            if cg.ends_here(state):
                break
            firsts = {cg.token_bytes[t][0] for t in cg.index.get_allowed_tokens(state) if t < cg.vocab_size}
            if len(firsts) != 1:
                break
            b = firsts.pop()
            tid = cg.single_byte_id.get(b)
            nxt = None if tid is None else cg.index.get_next_state(state, tid)
            if nxt is None:
                break
            out.append(b)
            state = nxt
        return out.decode("utf-8", errors="ignore")  # drop an incomplete trailing character


def _set_bits(row: torch.Tensor, ids: torch.Tensor) -> None:
    if ids.numel() == 0:
        return
    words = ids // 32
    bits = torch.bitwise_left_shift(torch.ones_like(ids), ids % 32)
    # OR bits into their words: scatter_reduce over int64 then write back as int32 bit patterns
    acc = torch.zeros(row.shape[0], dtype=torch.int64)
    acc.scatter_reduce_(0, words, bits, reduce="sum")  # ids are unique, so sum == OR
    acc |= row.to(torch.int64) & 0xFFFFFFFF
    row.copy_(torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32))


class OutlinesCompiled(CompiledGrammar):
    backend_name = "outlines"

    def __init__(self, spec: GrammarSpec, index: "oc.Index", backend: "OutlinesBackend", regex: str):
        self.spec = spec
        self.regex = regex
        self.index = index
        self.vocab_size = backend.vocab.vocab_size
        self.marker_id = backend.marker_id
        self.token_bytes = backend.vocab.token_bytes
        self.single_byte_id = backend.single_byte_id
        self.stop_ids = frozenset(backend.vocab.stop_token_ids)
        self.stop_tensor = torch.tensor(sorted(self.stop_ids), dtype=torch.int64)
        self.final_states = frozenset(index.get_final_states())
        self.suspect_ids = backend.suspect_ids
        self.partial_ids = backend.partial_ids
        self.words = (self.vocab_size + 31) // 32
        self._mask_cache: dict[int, torch.Tensor] = {}

    def allowed_words(self, state: int) -> torch.Tensor:
        """The mask words of the real tokens allowed from state; cached: a DFA state fixes its
        continuations. Excluded: the marker, the private EOS, and real tokens that only live
        because they spell (part of) the marker: one landing in a final state, or one ending in
        a marker prefix whose next state allows nothing but the rest of the marker."""
        words = self._mask_cache.get(state)
        if words is None:
            idx = self.index
            ids = [t for t in idx.get_allowed_tokens(state) if t < self.vocab_size]
            ids = [t for t in ids if (t not in self.suspect_ids and t not in self.partial_ids) or self._legit(state, t)]
            words = torch.zeros(self.words, dtype=torch.int32)
            _set_bits(words, torch.tensor(ids, dtype=torch.int64))
            self._mask_cache[state] = words
        return words

    def _legit(self, state: int, t: int) -> bool:
        nxt = self.index.get_next_state(state, t)
        if nxt is None or nxt in self.final_states:
            return False
        rest = self.partial_ids.get(t)
        if rest is None:
            return True
        # legit only if something other than the marker's remaining bytes may follow
        for u in self.index.get_allowed_tokens(nxt):
            b = self.token_bytes[u] if u < self.vocab_size else None
            if b is not None and not rest.startswith(b):
                return True
        return False

    def ends_here(self, state: int) -> bool:
        """R may end at state: the marker leads into a final state (inside a string R may also
        allow the marker character itself, which leads elsewhere)."""
        return self.index.get_next_state(state, self.marker_id) in self.final_states

    def is_allowed(self, state: int, t: int) -> bool:
        """Whether real token t is in the mask at state."""
        if not 0 <= t < self.vocab_size:
            return False
        return bool((int(self.allowed_words(state)[t // 32]) >> (t % 32)) & 1)

    def new_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)


class OutlinesBackend(GrammarBackend):
    """Regex-based backend over outlines-core. EBNF is not supported (xgrammar and llguidance serve it)."""

    name = "outlines"

    def __init__(self, vocab: TokenizerVocab):
        self.vocab = vocab
        self.marker_id = vocab.vocab_size
        eos_id = vocab.vocab_size + 1  # private: stop tokens are handled by the matcher
        by_bytes: dict[bytes, list[int]] = {}
        self.single_byte_id: dict[int, int] = {}
        for i, b in enumerate(vocab.token_bytes):
            if b is None or i in vocab.stop_token_ids:
                continue
            by_bytes.setdefault(b, []).append(i)
            if len(b) == 1:
                self.single_byte_id.setdefault(b[0], i)
        self.marker = next((m for m in _MARKER_CANDIDATES if m.encode() not in by_bytes), None)
        if self.marker is None:
            raise GrammarError("outlines: every end-marker candidate is a real token of this vocabulary")
        mk = self.marker.encode()
        # only a token ending in the marker's last byte can complete the marker
        self.suspect_ids = frozenset(i for ids in by_bytes.values() for i in ids if vocab.token_bytes[i][-1] == mk[-1])
        # a token ending in a proper prefix of the marker may be starting it: id -> rest of marker
        self.partial_ids: dict[int, bytes] = {}
        for b, ids in by_bytes.items():
            for n in range(len(mk) - 1, 0, -1):
                if b.endswith(mk[:n]):
                    for i in ids:
                        self.partial_ids[i] = mk[n:]
                    break
        by_bytes[self.marker.encode()] = [self.marker_id]
        self._vocabulary = oc.Vocabulary(eos_id, by_bytes)

    def regex_for(self, spec: GrammarSpec) -> str:
        """The regex outlines compiles for spec (before the end marker)."""
        if spec.kind == "regex":
            return spec.text
        if spec.kind == "choices":
            return "|".join(regex_escape(c) for c in json.loads(spec.text))
        if spec.kind in ("json_schema", "json_object"):
            try:
                return oc.json_schema.build_regex_from_schema(spec.text)
            except Exception as e:
                raise GrammarError(f"invalid JSON schema (outlines): {e}") from e
        raise GrammarError(f"unsupported grammar kind {spec.kind!r} for outlines (EBNF needs xgrammar or llguidance)")

    def compile(self, spec: GrammarSpec) -> OutlinesCompiled:
        regex = self.regex_for(spec)
        for m in _REPEAT_RE.finditer(regex):
            bound = max(int(m.group(1)), int(m.group(2) or 0))
            if bound > MAX_REPEAT:
                raise GrammarError(
                    f"repetition {m.group(0)} exceeds {MAX_REPEAT} for outlines (its DFA would be huge); use xgrammar"
                )
        wrapped = f"(?:{regex})\\x{{{ord(self.marker):x}}}"
        try:
            index = oc.Index(wrapped, self._vocabulary)
        except Exception as e:
            if "incompatible with the regex" in str(e) and self.single_byte_id.keys() >= set(range(0x20, 0x7F)):
                # the vocabulary spells every printable byte, so no path to the end = empty language
                raise InvalidSpecError(f"{spec.kind} spec admits no output (its language is empty; outlines)") from e
            raise GrammarError(f"invalid regex (outlines): {e}") from e
        out = OutlinesCompiled(spec, index, self, regex)
        out.strict = spec.kind == "json_schema"  # its schema regexes admit declared properties only
        return out
