"""Per-role prefix/suffix text derived once from the model's own chat template.

Programs build chats turn by turn, so instead of re-rendering the whole message list at every
turn we render a few probe conversations whose contents are unique sentinels and cut the output
at the sentinels. A turn of role r is then written as

    start[r] (only for the program's first turn) + prefix[r] + content + suffix[r]

which concatenates to exactly what the template renders for the full message list, for
templates whose per-turn text does not depend on the position of the turn (ChatML, Llama-3,
SmolLM2, Qwen2, Mistral-style ...). `start[r]` carries what the template puts before the first
turn when that turn is r: a literal BOS, or a default system prompt injected when the
conversation does not begin with one (SmolLM2, Qwen2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import InvalidRequestError

_S = "QzSysSentinelQz"
_U1, _U2 = "QzUserOneQz", "QzUserTwoQz"
_A1, _A2 = "QzAsstOneQz", "QzAsstTwoQz"


@dataclass
class RoleFormat:
    """Text around each role's content; see the module docstring."""

    start: dict[str, str] = field(default_factory=dict)
    prefix: dict[str, str] = field(default_factory=dict)
    suffix: dict[str, str] = field(default_factory=dict)
    source: str = "template"  # "template" or "fallback" (no usable chat template)
    trim: bool = False  # the template strips whitespace around contents (Llama-3's `| trim`)

    def supports(self, role: str) -> bool:
        return role in self.prefix


def _fallback() -> RoleFormat:
    """Plain "Role: text" turns for models without a chat template (base models)."""
    roles = ("system", "user", "assistant")
    return RoleFormat(
        start={r: "" for r in roles},
        prefix={r: f"{r.capitalize()}: " for r in roles},
        suffix={r: "\n" for r in roles},
        source="fallback",
    )


def _render(tok: Any, messages: list[tuple[str, str]], gen: bool) -> str:
    return tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=gen)


def _cut(text: str, sentinels: list[str]) -> list[str]:
    """Pieces of `text` between consecutive sentinels (len(sentinels) + 1 pieces)."""
    pieces, pos = [], 0
    for s in sentinels:
        i = text.index(s, pos)
        pieces.append(text[pos:i])
        pos = i + len(s)
    pieces.append(text[pos:])
    return pieces


def _strip_suffix(text: str, suffix: str) -> str:
    if suffix and not text.endswith(suffix):
        raise ValueError("inconsistent template pieces")
    return text[: len(text) - len(suffix)] if suffix else text


def _strip_prefix(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise ValueError("inconsistent template pieces")
    return text[len(prefix):]


def analyze_chat_template(tokenizer: Any) -> RoleFormat:
    """Derive a RoleFormat from `tokenizer.apply_chat_template`, or the plain fallback.

    Templates that reject a system turn yield a format without "system" (using di.system then
    raises a typed error). Anything that cannot be cut consistently falls back to plain turns.
    """
    try:
        return _analyze(tokenizer)
    except Exception:  # no template, template rejects the probes, or pieces are inconsistent
        return _fallback()


def _analyze(tok: Any) -> RoleFormat:
    # user/assistant structure, from a conversation without a system turn.
    full = _render(tok, [("user", _U1), ("assistant", _A1), ("user", _U2), ("assistant", _A2)], False)
    head, u1_a1, a1_u2, u2_a2, tail = _cut(full, [_U1, _A1, _U2, _A2])
    gen_prompt = _render(tok, [("user", _U1)], True)
    no_gen = _render(tok, [("user", _U1)], False)
    suffix_user = _cut(no_gen, [_U1])[1]  # user turn rendered last, without a generation prompt
    prefix_asst = _strip_prefix(gen_prompt, no_gen) if gen_prompt.startswith(no_gen) else ""
    if not prefix_asst:
        prefix_asst = _strip_prefix(u1_a1, suffix_user)
    if u1_a1 != suffix_user + prefix_asst:
        raise ValueError("user suffix + assistant prefix do not match the template")
    suffix_asst = tail
    prefix_user = _strip_prefix(a1_u2, suffix_asst)
    if u2_a2 != suffix_user + prefix_asst:
        raise ValueError("second user turn differs from the first")
    start_user = _strip_suffix(head, prefix_user)
    padded = _render(tok, [("user", " " + _U1 + " ")], False)
    fmt = RoleFormat(
        start={"user": start_user, "assistant": start_user},
        prefix={"user": prefix_user, "assistant": prefix_asst},
        suffix={"user": suffix_user, "assistant": suffix_asst},
        trim=" " + _U1 + " " not in padded,
    )
    # system turn, if the template accepts one.
    try:
        with_sys = _render(tok, [("system", _S), ("user", _U1)], False)
    except InvalidRequestError:
        return fmt
    except Exception:
        return fmt
    sys_head, sys_user, _ = _cut(with_sys, [_S, _U1])
    bos_text = getattr(tok, "bos_token", None) or ""
    # The text before a leading system content is start + prefix; only a literal BOS counts as start.
    # (SmolLM2's "BOS" is <|im_start|>, which also opens every turn: then it is not a start marker.)
    is_start = bos_text and sys_head.startswith(bos_text) and start_user.startswith(bos_text)
    start_sys = bos_text if is_start and not prefix_user.startswith(bos_text) else ""
    fmt.start["system"] = start_sys
    fmt.prefix["system"] = sys_head[len(start_sys):]
    fmt.suffix["system"] = _strip_suffix(sys_user, prefix_user)
    return fmt
