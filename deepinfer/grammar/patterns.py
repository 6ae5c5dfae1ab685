"""Exact rewrites of string `pattern`s before the backends compile a JSON schema.

xgrammar ignores minLength/maxLength next to a pattern and approximates anchors inside one
(its warnings), so such schemas went to llguidance, exact but ~10x slower per mask fill (p50
100-800 us against xgrammar's 8 us on the JSONSchemaBench subsets: most of the mask-time tail).
Each rewrite keeps the set of valid strings (JSON Schema: the pattern is searched, unanchored;
lengths count code points):

- anchors hoisted out of an alternation whose every branch is anchored at both ends:
  `^$|(^X$)` -> `^(?:|X)$`;
- a pattern that is one single-character atom repeated, anchored at both ends (`^[a-z]+$`), takes
  the length bounds into its repetition: `^[a-z]{30,40}$`, and minLength/maxLength go;
- an unanchored single-character class with a small maxLength (`[0-9a-f]+`, i.e. "contains one
  of these"; length 12) becomes the anchored alternation over where its first occurrence is:
  `^(?:[0-9a-f][\\s\\S]{11}|[^0-9a-f][0-9a-f][\\s\\S]{10}|...)$`.

Anything else is left as it is (the exactness table then reports what the backend approximates).
"""

from __future__ import annotations

import re
from typing import Any

_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
MAX_REPEAT = 1024  # repetition bounds past this stay keywords (backends expand repetitions)
MAX_POSITIONS = 32  # alternatives of the "contains one" rewrite
# one code point: a class without nested brackets, an escape class, a dot, or a plain character
_ATOM = r"(?:\[(?:\\.|[^\]\\])+\]|\\[dDwWsS]|\.|[^\\\[\](){}|^$*+?.])"
_SINGLE = re.compile(rf"^\^({_ATOM})([+*])\$$")
_CLASS = re.compile(r"^(\[(?:\\.|[^\]\\])+\]|\\[dws])([+])?$")


def lower_patterns(schema: Any) -> Any:
    """schema with the pattern rewrites applied (the input itself when nothing changes)."""
    out = _map(schema)
    return schema if out == schema else out


def _map(s: Any) -> Any:
    if isinstance(s, list):
        return [_map(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: v if k in _DATA else _map(v) for k, v in s.items()}
    if isinstance(out.get("pattern"), str):
        out = _lower_string(out)
    return out


def _lower_string(s: dict) -> dict:
    p = hoist_anchors(s["pattern"])
    lo, hi = s.get("minLength"), s.get("maxLength")
    if "minLength" not in s and "maxLength" not in s:
        return s if p == s["pattern"] else {**s, "pattern": p}
    lo = lo if "minLength" in s else 0
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (lo, hi) if v is not None) \
            or (hi is not None and lo > hi):
        return s  # non-integer or contradictory bounds: left to the checks
    folded = fold_lengths(p, lo, hi)
    if folded is None:
        # the lengths stay, and xgrammar approximates them anyway: hoisting would only make
        # its compile heavier (Github_easy 207, a {0,99} group: 35 s against 19 s, under load)
        return s
    out = {k: v for k, v in s.items() if k not in ("minLength", "maxLength")}
    out["pattern"] = folded
    return out


def _split_top(p: str) -> list[str] | None:
    """p's top-level alternatives (None when the brackets do not balance)."""
    parts, depth, i, start, in_cls = [], 0, 0, 0, False
    while i < len(p):
        c = p[i]
        if c == "\\":
            i += 2
            continue
        if in_cls:
            in_cls = c != "]"
        elif c == "[":
            in_cls = True
            if p[i + 1 : i + 2] == "]" or p[i + 1 : i + 3] == "^]":  # a leading ] is literal
                i += 2 if p[i + 1] == "]" else 3
                continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                return None
        elif c == "|" and depth == 0:
            parts.append(p[start:i])
            start = i + 1
        i += 1
    if depth or in_cls:
        return None
    parts.append(p[start:])
    return parts


def _unwrap(b: str) -> str:
    """b without one group that spans all of it."""
    for open_ in ("(?:", "("):
        if b.startswith(open_) and b.endswith(")") and not b.endswith("\\)"):
            inner = b[len(open_) : -1]
            if _split_top(inner) is not None and _balanced_prefixes(inner):
                return inner
    return b


def _balanced_prefixes(p: str) -> bool:
    """Whether no prefix of p closes more groups than it opens (so the outer group is one group)."""
    depth, i, in_cls = 0, 0, False
    while i < len(p):
        c = p[i]
        if c == "\\":
            i += 2
            continue
        if in_cls:
            in_cls = c != "]"
        elif c == "[":
            in_cls = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                return False
        i += 1
    return True


def _anchored(b: str) -> str | None:
    """The inside of a branch `^X$` (X free of other anchors), or None."""
    if not (b.startswith("^") and b.endswith("$")) or len(b) < 2:
        return None
    inner = b[1:-1]
    k = len(inner) - len(inner.rstrip("\\"))
    if k % 2:  # `\$`: an escaped dollar, not an anchor
        return None
    if _has_anchor(inner):
        return None
    return inner


def _has_anchor(p: str) -> bool:
    i, in_cls = 0, False
    while i < len(p):
        c = p[i]
        if c == "\\":
            i += 2
            continue
        if in_cls:
            in_cls = c != "]"
        elif c == "[":
            in_cls = True
            if p[i + 1 : i + 2] == "^":
                i += 1
        elif c in "^$":
            return True
        i += 1
    return False


def hoist_anchors(p: str) -> str:
    """`^A$|^B$` (each branch possibly in a group) -> `^(?:A|B)$`; p itself when not of that form."""
    parts = _split_top(p)
    if parts is None or len(parts) < 2:
        return p
    inners = [_anchored(_unwrap(b)) for b in parts]
    if any(x is None for x in inners):
        return p
    return "^(?:" + "|".join(inners) + ")$"


def _negate(atom: str) -> str | None:
    if atom.startswith("[^"):
        return "[" + atom[2:]
    if atom.startswith("["):
        return "[^" + atom[1:]
    if atom in ("\\d", "\\w", "\\s"):
        return atom.upper()
    return None


def fold_lengths(p: str, lo: int, hi: int | None) -> str | None:
    """A pattern accepting exactly the strings p accepts (searched) whose length lies in
    [lo, hi], for the two shapes above; None when p has neither or the bounds are too large."""
    m = _SINGLE.match(p)
    if m is not None:
        atom, q = m.groups()
        low = max(lo, 1 if q == "+" else 0)
        if hi is not None and (low > hi or hi > MAX_REPEAT):
            return None
        if low > MAX_REPEAT:
            return None
        rep = f"{{{low}}}" if hi == low else f"{{{low},{'' if hi is None else hi}}}"
        return f"^{atom}{rep}$"
    m = _CLASS.match(p)
    if m is None or hi is None or hi > MAX_POSITIONS or hi < 1 or lo > hi:
        return None
    atom = m.group(1)
    neg = _negate(atom)
    if neg is None:
        return None
    alts = []
    for i in range(hi):  # the first occurrence at position i
        rest_lo, rest_hi = max(lo - i - 1, 0), hi - i - 1
        rest = f"[\\s\\S]{{{rest_lo}}}" if rest_lo == rest_hi else f"[\\s\\S]{{{rest_lo},{rest_hi}}}"
        alts.append((f"{neg}{{{i}}}" if i else "") + atom + rest)
    return "^(?:" + "|".join(alts) + ")$"
