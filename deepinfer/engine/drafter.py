"""Draft tokens for speculative decoding, verified by the target model in the next step.

`NgramDrafter` (prompt lookup): the longest n-gram ending a sequence (max_n down to min_n tokens)
that also occurs earlier in its tokens (prompt and output) proposes what followed it there. Free to
compute, and strong where the output copies its input (extraction, summaries, rewrites, code edits).
Where the sequence itself has no match, a `SuffixIndex` over the outputs of the engine's finished
requests is asked (records of one job repeat keys and phrasing).
"""

from __future__ import annotations

from collections import OrderedDict


class SuffixIndex:
    """n-grams (n = min_n..max_n) of finished outputs -> where they occurred, newest kept; bounded."""

    def __init__(self, min_n: int = 2, max_n: int = 4, max_entries: int = 1 << 20):
        self.min_n, self.max_n = min_n, max_n
        self.max_entries = max_entries
        self._at: OrderedDict[tuple, tuple[list[int], int]] = OrderedDict()

    def add(self, tokens: list[int]) -> None:
        tokens = list(tokens)
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n - 1, len(tokens) - 1):
                key = tuple(tokens[end - n + 1 : end + 1])
                self._at[key] = (tokens, end + 1)
                self._at.move_to_end(key)
        while len(self._at) > self.max_entries:
            self._at.popitem(last=False)

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._at.get(tuple(tokens[len(tokens) - n :]))
            if hit is not None:
                src, start = hit
                return src[start : start + k], n
        return [], 0


class NgramDrafter:
    def __init__(self, max_draft: int, min_n: int = 1, max_n: int = 4, index: SuffixIndex | None = None):
        if max_draft < 1 or min_n < 1 or max_n < min_n:
            raise ValueError(f"NgramDrafter: need max_draft >= 1 and 1 <= min_n <= max_n, got {max_draft}, {min_n}, {max_n}")
        self.max_draft = max_draft
        self.min_n = min_n
        self.max_n = max_n
        self.index = index

    def propose_keyed(self, tokens: list[int], k: int) -> tuple[list[int], tuple]:
        """Drafts and the key their acceptance is learned under: ("ngram", n) for a match in the
        sequence itself, ("suffix", n) for one in other requests' outputs."""
        own, n = self.propose(tokens, k)
        if own and n >= 2 or self.index is None:
            return own, ("ngram", n)
        other, m = self.index.lookup(tokens, min(k, self.max_draft))
        if other and m > n:
            return other, ("suffix", m)
        return own, ("ngram", n)

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to min(k, max_draft) tokens that followed the most recent earlier match of the longest
        matching suffix, and that suffix's length n (0 and [] when nothing matches)."""
        k = min(k, self.max_draft)
        L = len(tokens)
        if k < 1 or L < self.min_n + 1:
            return [], 0
        last = tokens[-1]
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            pattern = tokens[L - n :]
            # the match tokens[end - n + 1 : end + 1] ends before the suffix itself; most recent first
            for end in range(L - 2, n - 2, -1):
                if tokens[end] == last and tokens[end - n + 1 : end + 1] == pattern:
                    return tokens[end + 1 : end + 1 + k], n
        return [], 0
