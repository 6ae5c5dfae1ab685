"""Complete within budget: when the tokens left approach what the grammar needs to close, allow
only tokens after which a completion still fits (SamplingParams.complete_within_budget).

The tokens a state needs are bounded from above by a greedy closing path: from the matcher's
state, repeatedly take the first allowed token of a preference list (closing quotes and
brackets, then the shortest values), else the lowest allowed id that is not whitespace, until the
grammar can terminate. Once the budget is within MARGIN tokens of that bound, the row's mask keeps
only the path's next token and those of the model's top candidates whose own closing path still
fits (each checked by accepting it and rolling back), plus the stop tokens where the grammar can end.
So every step taken in that zone leaves a completion that fits. Before the zone the model is free;
one token that makes the bound jump by more than MARGIN (an object with many required keys opened
at the last moment) can still run out, which is why MARGIN is generous.

JSON outputs (a schema, json_object, dtype str) walk with a two-state lexer (inside a string or
not, escape pending) started from the output's bytes so far: a closer's bytes mean different
things on either side of a quote. Without it, at a string value's start the walk took `"}` (which
opens a string holding "}") and then `}}` as string content forever, found no path and left the
mask alone: 1 of the 3 length-capped outputs in 200 runs of a {name: str, age: int} schema at
max_tokens=48 on SmolLM2-135M (guard on). Inside a string a quote-led closer goes first; outside
one, a token that would open a string is taken only after the short values (`""` among them).
"""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from deepinfer_kernels import bitmask as native_bitmask

MARGIN = 16  # tokens of slack before the guard starts to restrict
_LONGEST = 64  # token lengths past this rank alike
TOP_K = 4  # the model's best allowed tokens checked in the guarded zone
_PREFERRED = (b'"}', b'"]', b"}}", b"]}", b"}]", b"]]", b'"', b"}", b"]", b"0", b'""', b"[]", b"{}",
              b"1", b"null", b"true", b"false", b"a", b":")
# the JSON-aware orders: inside a string the closing quote first (brackets there are content; `",`
# is left out: in an array it opens the next item, and a vocabulary without `"]` looped on `",` `"`);
# outside, never `"}` / `"]` (they open a string) and a lone quote (a string or key opened) last
_IN_STRING = (b'"}', b'"]', b'":', b'"')  # then the longest allowed token (_rank)
_OUTSIDE = (b"}}", b"]}", b"}]", b"]]", b"}", b"]", b"0", b'""', b"[]", b"{}", b"1", b"null", b"true",
            b"false", b":", b'"', b"a")

#: lexer state of JSON text: (inside a string, escape pending); None = not JSON (no lexing)
JsonLex = tuple[bool, bool]
JSON_START: JsonLex = (False, False)


def lex_json(state: JsonLex, data: bytes) -> JsonLex:
    """The lexer state after data (exact for text a JSON grammar accepted)."""
    in_str, esc = state
    if not in_str and b'"' not in data:
        return state
    for byte in data:
        if in_str:
            if esc:
                esc = False
            elif byte == 0x5C:  # backslash
                esc = True
            elif byte == 0x22:
                in_str = False
        elif byte == 0x22:
            in_str = True
    return in_str, esc


class BudgetGuard:
    """Per vocabulary: the preferred closing tokens, and the mask restriction."""

    def __init__(self, token_bytes: list[bytes | None], stop_ids: list[int], vocab_size: int):
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self.token_bytes = token_bytes
        by_bytes = {b: i for i, b in reversed(list(enumerate(token_bytes))) if b is not None}
        self.preferred = [by_bytes[b] for b in _PREFERRED if b in by_bytes]
        self._in_string = [by_bytes[b] for b in _IN_STRING if b in by_bytes]
        self._outside = [by_bytes[b] for b in _OUTSIDE if b in by_bytes]
        # off the preference lists, the longest allowed token first: a key or an enum value is then
        # written in its longest tokens (`age` rather than `a`, `g`, `e`): by lowest id, SmolLM2's
        # single bytes, Person's closing path from `{` was 16 tokens instead of 10 and a 14-token
        # budget could not close; whitespace last: it never closes anything
        base = len(self.preferred) + 2
        self._rank = torch.full((vocab_size,), base + _LONGEST, dtype=torch.int64)
        for i, b in enumerate(token_bytes):
            if b is not None:
                self._rank[i] = base + _LONGEST + 1 if b.strip() == b"" else base + _LONGEST - min(len(b), _LONGEST)
        for r, t in enumerate(self.preferred):
            self._rank[t] = r
        self._rank[self.stop_ids] = 1 << 40  # never part of a path: ending is checked separately
        self._mask = allocate_token_bitmask(1, vocab_size)

    def _order(self, lex: JsonLex | None) -> list[int]:
        if lex is None or lex[1]:  # not JSON, or an escape pending (any byte is content then)
            return self.preferred
        return self._in_string if lex[0] else self._outside

    def _advance(self, lex: JsonLex | None, t: int) -> JsonLex | None:
        b = self.token_bytes[t] if 0 <= t < len(self.token_bytes) else None
        return lex if lex is None or b is None else lex_json(lex, b)

    def closing_path(self, matcher, limit: int, lex: JsonLex | None = None) -> list[int] | None:
        """Greedy tokens that bring matcher to a state where it can terminate (the matcher is
        left as it was); None when none found within limit tokens. lex: the JSON lexer state of
        the text the matcher has accepted (None: not JSON)."""
        path: list[int] = []
        try:
            while not matcher.can_terminate():
                if len(path) >= limit:
                    return None
                matcher.fill_bitmask(self._mask, 0)
                words = self._mask[0]
                t = next((p for p in self._order(lex) if (int(words[p // 32]) >> (p % 32)) & 1), None)
                if t is None:  # none of the closers: the lowest-ranked allowed token (natively where it can)
                    t = native_bitmask.min_rank_token(words, self._rank)
                    if t is False:
                        ids = allowed_token_ids(words, self.vocab_size)
                        t = int(ids[torch.argmin(self._rank[ids] * self.vocab_size + ids)]) if ids.numel() else None
                    if t is None:
                        return None
                if t in self.stop_ids or not matcher.accept_token(t):
                    return None
                path.append(t)
                lex = self._advance(lex, t)
            return path
        finally:
            if path:
                matcher.rollback(len(path))

    def restrict(self, matcher, bitmask: torch.Tensor, row: int, logits: torch.Tensor, tokens_left: int,
                 lex: Callable[[], JsonLex | None] | None = None) -> None:
        """Narrow bitmask[row] (already filled from matcher) so that a completion, stop token
        included, fits in tokens_left tokens (this step's token counts). lex: gives the JSON lexer
        state of the text the matcher has accepted (None, or giving None: not JSON); called only
        when a closing path is walked."""
        if not getattr(matcher, "supports_rollback", False) or matcher.is_terminated():
            return
        # far from the zone, the bound is refreshed only every MARGIN // 2 tokens (it is a greedy
        # walk of mask fills); the zone is entered with MARGIN tokens of slack
        last = getattr(matcher, "_budget_last", None)
        if last is not None and tokens_left > last[1] + 2 * MARGIN and last[0] - tokens_left < MARGIN // 2:
            return
        state = lex() if lex is not None else None
        path = self.closing_path(matcher, tokens_left, state)
        if path is None and state is not None:  # a greedy walk can still loop: the plain order too
            path = self.closing_path(matcher, tokens_left)
            state = None if path is not None else state
        matcher._budget_last = (tokens_left, len(path) if path is not None else tokens_left)
        if path is None or tokens_left > len(path) + 1 + MARGIN:
            return  # cannot close anyway (the mask is left alone) or plenty of room
        keep = set(path[:1])
        allowed = allowed_token_ids(bitmask[row], self.vocab_size)
        allowed = allowed[~torch.isin(allowed, torch.tensor(self.stop_ids, dtype=allowed.dtype))]
        if allowed.numel():
            scores = logits[allowed.to(logits.device)].float().cpu()
            for t in allowed[torch.topk(scores, min(TOP_K, allowed.numel())).indices].tolist():
                if t in keep or not matcher.accept_token(t):
                    continue
                rest = self.closing_path(matcher, tokens_left - 2, self._advance(state, t))
                matcher.rollback(1)
                if rest is not None and 1 + len(rest) + 1 <= tokens_left:
                    keep.add(t)
        can_end = matcher.can_terminate()
        out = bitmask[row]
        out.zero_()
        ids = sorted(keep | (set(self.stop_ids) if can_end else set()))
        for t in ids:
            word = t // 32
            bit = 1 << (t % 32)
            out[word] = int(out[word]) | (bit - (1 << 32) if bit >= 1 << 31 else bit)
