"""Compile-time proof that a constraint matches no string at all, so such a request is refused at
submission (GrammarError) instead of failing at its first sampled token.

A conservative check (it reports "empty" only when sure); any kind whose fresh matcher allows no
token and cannot end is refused by `compiler.check_nonempty`.
- `regex_is_empty`: walks Python's parse of the regex; a class like `[^\\s\\S]` (a category and
  its complement, negated) or a negative lookahead of the empty string matches nothing, and a
  sequence holding one such part is empty too. Regexes Python cannot parse are left to the backend.
"""

from __future__ import annotations

import re
import warnings

try:  # the parser moved in Python 3.11
    import re._constants as _c
    import re._parser as _sre
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _sre  # type: ignore[no-redef]

_COMPLEMENTS = [
    {_c.CATEGORY_DIGIT, _c.CATEGORY_NOT_DIGIT},
    {_c.CATEGORY_SPACE, _c.CATEGORY_NOT_SPACE},
    {_c.CATEGORY_WORD, _c.CATEGORY_NOT_WORD},
]
_MAX_UNICODE = 0x10FFFF
_REPEATS = tuple(x for x in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)) if x is not None)


def _class_is_empty(items: list) -> bool:
    """A character class [...] that no character matches (only a negated class can be)."""
    if not items or items[0][0] is not _c.NEGATE:
        return False
    cats = {arg for op, arg in items if op is _c.CATEGORY}
    if any(pair <= cats for pair in _COMPLEMENTS):
        return True
    spans = sorted((arg, arg) if op is _c.LITERAL else arg for op, arg in items if op in (_c.LITERAL, _c.RANGE))
    covered = -1  # the class covers 0..covered
    for lo, hi in spans:
        if lo > covered + 1:
            return False
        covered = max(covered, hi)
    return covered >= _MAX_UNICODE


def _matches_empty_string(seq) -> bool | None:
    """Whether a parsed sequence surely matches "" (None: not sure)."""
    for op, arg in seq:
        if op in _REPEATS and arg[0] == 0:
            continue
        if op is _c.SUBPATTERN and _matches_empty_string(arg[-1]):
            continue
        if op is _c.AT:
            return None
        return False
    return True


def _empty(seq) -> bool:
    """True when the parsed sequence surely matches nothing."""
    for op, arg in seq:
        if op is _c.IN and _class_is_empty(arg):
            return True
        if op is _c.SUBPATTERN and _empty(arg[-1]):
            return True
        if op is _c.BRANCH and all(_empty(alt) for alt in arg[1]):
            return True
        if op in _REPEATS and arg[0] > 0 and _empty(arg[2]):
            return True
        if op is getattr(_c, "ATOMIC_GROUP", None) and _empty(arg):
            return True
        if op is _c.ASSERT and _empty(arg[1]):
            return True
        if op is _c.ASSERT_NOT and _matches_empty_string(arg[1]):  # (?!) and the like
            return True
    return False


def regex_is_empty(pattern: str) -> bool:
    """True when `pattern` surely matches no string (False also when Python cannot parse it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. FutureWarning on nested sets: not our concern here
            parsed = _sre.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError, TypeError):
        return False
    try:
        return _empty(list(parsed))
    except RecursionError:
        return False
