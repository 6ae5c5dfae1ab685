"""Jump-forward decoding: append the grammar's forced continuation without sampling it.

Boundary rule. Tokens already sampled are never re-tokenised: the forced string s is tokenised
on its own, as if a token boundary sat exactly at the current position. Then tokens are
appended one at a time, each only if (a) its bytes are exactly the next bytes of s (so the
concatenation of appended tokens is always a byte-prefix of s) and (b) the matcher's mask
allows it and the matcher accepts it. The first token failing either check stops the jump;
what was accepted stays accepted (the matcher is left after the appended tokens).
By default every validated token is kept, since the matcher proved each one legal. With
hold_last=True the last token of s's tokenisation is not appended, so the model may merge the
tail of s with what it writes next (e.g. ` "` then a key's first letters) at the cost of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.grammar.backend import MAX_JUMP_FORWARD_BYTES, GrammarMatcher
from deepinfer.grammar.bitmask import allocate_token_bitmask


@dataclass
class JumpForward:
    """The appended continuation: its text (decoded bytes of token_ids) and the token ids."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    forced: str = ""  # the full forced string the matcher reported


def jump_forward(
    matcher: GrammarMatcher,
    tokenizer,
    token_bytes: list[bytes | None],
    hold_last: bool = False,
    max_bytes: int = MAX_JUMP_FORWARD_BYTES,
    truncate: bool = False,
) -> JumpForward:
    """Feed the matcher's forced continuation into it and return what was appended.

    tokenizer: a tokenizers.Tokenizer (encodes the forced string); token_bytes: bytes per token
    id (GrammarCompiler.token_bytes). See the module docstring for the boundary rule.
    max_bytes: a forced string longer than this is not jumped at all (every token is at least one
    byte, so max_bytes = the tokens a request has left keeps the jump within its budget), or with
    truncate=True only its first max_bytes bytes are (for drafts, which are verified anyway).
    """
    if max_bytes <= 0:
        return JumpForward("", [], "")
    forced = matcher.find_jump_forward_string(max_bytes + 1)  # one more byte tells "longer" apart
    if forced and truncate and len(forced.encode("utf-8")) > max_bytes:
        forced = forced.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    if not forced or matcher.is_terminated() or len(forced.encode("utf-8")) > max_bytes:
        return JumpForward("", [], forced)
    target = forced.encode("utf-8")
    ids = tokenizer.encode(forced, add_special_tokens=False).ids
    if hold_last and ids:
        ids = ids[:-1]
    vocab_size = len(token_bytes)
    mask = allocate_token_bitmask(1, vocab_size)
    accepted: list[int] = []
    done = 0
    for t in ids:
        b = token_bytes[t] if 0 <= t < vocab_size else None
        if not b or target[done : done + len(b)] != b:
            break
        matcher.fill_bitmask(mask, 0)
        if not (int(mask[0, t // 32]) >> (t % 32)) & 1:
            break
        if not matcher.accept_token(t):
            break
        accepted.append(t)
        done += len(b)
    return JumpForward(target[:done].decode("utf-8", errors="replace"), accepted, forced)
