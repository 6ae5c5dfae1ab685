"""Draft tokens for speculative decoding, verified by the target model in the next step.

`NgramDrafter` (prompt lookup): the longest n-gram ending a sequence (max_n down to min_n tokens)
that also occurs earlier in its tokens (prompt and output) proposes what followed it there. Free to
compute, and strong where the output copies its input (extraction, summaries, rewrites, code edits).
"""

from __future__ import annotations


class NgramDrafter:
    def __init__(self, max_draft: int, min_n: int = 1, max_n: int = 4):
        if max_draft < 1 or min_n < 1 or max_n < min_n:
            raise ValueError(f"NgramDrafter: need max_draft >= 1 and 1 <= min_n <= max_n, got {max_draft}, {min_n}, {max_n}")
        self.max_draft = max_draft
        self.min_n = min_n
        self.max_n = max_n

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
