"""Bounded whitespace between JSON elements, enforced outside the backend's grammar.

A JSON grammar allows whitespace between elements; unbounded, a sampled model can spin on
newlines forever, so the backends were asked for at most MAX_JSON_WHITESPACE bytes per gap.
xgrammar implements that count inside its grammar, which made most of its mask fills
context-dependent: on the JSONSchemaBench subsets (747 schemas, SmolLM2 tokenizer, CPU time per
fill) its p50 went 8 -> 26 us and p99 58 -> 229 us against unbounded whitespace. So xgrammar
compiles JSON with unbounded whitespace and this guard bounds it per matcher instead:

- it follows the accepted bytes with a two-state JSON lexer (inside a string or not, escape
  pending) -- exact, since the grammar only lets valid JSON through -- and counts the run of
  whitespace bytes outside strings that the text ends with;
- once that run has reached the limit, every token that starts with whitespace is taken out of
  the mask and refused by accept_token, so a gap ends with at most limit - 1 bytes plus one
  token's whitespace. Whitespace inside a string is content and never counted. Checking each
  token against the exact room left on every fill after whitespace cost a pass over the mask row
  (p50 45 us under load, more than xgrammar's own fill, p50 7 us); this check runs only on a run
  that already reached the limit, i.e. only when a model spins.

Whitespace is never required between JSON elements, so a non-whitespace continuation is always
allowed; should a grammar still leave nothing else, the guard leaves the mask as it is (and
accepts) rather than make it empty.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_JSON_WHITESPACE = 16  # bytes per gap; 16 still fits indented output
_WS = frozenset(b" \t\n\r")


class WhitespaceTables:
    """Per vocabulary: each token's leading whitespace, whether it is all whitespace, its
    trailing whitespace, and whether it holds a quote or backslash (the lexer must scan it);
    plus a mask row without the tokens that start with whitespace."""

    def __init__(self, token_bytes: list[bytes | None], words: int, limit: int = MAX_JSON_WHITESPACE):
        self.limit = limit
        self.token_bytes = token_bytes
        n = len(token_bytes)
        self.lead = np.zeros(n, dtype=np.int32)
        self.all_ws = np.zeros(n, dtype=bool)
        self.trail = np.zeros(n, dtype=np.int32)
        self.scan = np.zeros(n, dtype=bool)
        for t, b in enumerate(token_bytes):
            if not b:
                continue
            k = len(b) - len(b.lstrip(b" \t\n\r"))
            self.lead[t] = k
            self.all_ws[t] = k == len(b)
            self.trail[t] = len(b) - len(b.rstrip(b" \t\n\r"))
            self.scan[t] = b'"' in b or b"\\" in b
        # Python lists for the per-token path (numpy scalar indexing costs ~100 ns each)
        self.lead_l, self.all_ws_l = self.lead.tolist(), self.all_ws.tolist()
        self.trail_l, self.scan_l = self.trail.tolist(), self.scan.tolist()
        # keep: int32 mask words with every token allowed except those starting with whitespace
        ban = np.zeros(words, dtype=np.uint32)
        ids = np.flatnonzero(self.lead > 0)
        np.bitwise_or.at(ban, ids // 32, np.uint32(1) << (ids % 32).astype(np.uint32))
        self.keep = (~ban).view(np.int32)


class WhitespaceGuard:
    """One matcher's lexer state: (inside a string, escape pending, whitespace run) per accepted
    token, as a stack so rollback can pop it."""

    __slots__ = ("_t", "_stack")

    def __init__(self, tables: WhitespaceTables):
        self._t = tables
        self._stack = [(False, False, 0)]

    def reset(self) -> None:
        del self._stack[1:]

    def over(self, token_id: int) -> bool:
        """Whether the run has reached the limit and token_id starts with whitespace."""
        in_str, _, run = self._stack[-1]
        if in_str or run < self._t.limit or not 0 <= token_id < len(self._t.lead_l):
            return False
        return self._t.lead_l[token_id] > 0

    def restrict(self, bitmask: torch.Tensor, row: int) -> bool:
        """Take the tokens that would extend a run at the limit out of bitmask[row]. False when
        that left the row empty (the caller then refills it unrestricted: no JSON grammar should
        need this, whitespace is never required)."""
        in_str, _, run = self._stack[-1]
        if in_str or run < self._t.limit:
            return True
        keep = self._t.keep
        if bitmask.device.type != "cpu":
            out = bitmask[row]
            out &= torch.from_numpy(keep).to(out.device)
            return bool(out.any())
        view = bitmask.numpy()[row]
        n = min(len(view), len(keep))
        np.bitwise_and(view[:n], keep[:n], out=view[:n])
        return bool(view.any())

    def push(self, token_id: int) -> None:
        """Advance over an accepted token's bytes."""
        t = self._t
        in_str, esc, run = self._stack[-1]
        if not 0 <= token_id < len(t.scan_l) or t.token_bytes[token_id] is None:
            self._stack.append((in_str, esc, run))  # a stop or special token: no text
            return
        if not t.scan_l[token_id] and not esc:
            if in_str:
                self._stack.append((True, False, 0))
            elif t.all_ws_l[token_id]:
                self._stack.append((False, False, run + t.lead_l[token_id]))
            else:
                self._stack.append((False, False, t.trail_l[token_id]))
            return
        for byte in t.token_bytes[token_id]:
            if in_str:
                if esc:
                    esc = False
                elif byte == 0x5C:  # backslash
                    esc = True
                elif byte == 0x22:  # closing quote
                    in_str = False
                run = 0
            elif byte in _WS:
                run += 1
            else:
                in_str = byte == 0x22
                run = 0
        self._stack.append((in_str, esc, run))

    def pop(self, n: int) -> None:
        if n:
            del self._stack[-n:]
