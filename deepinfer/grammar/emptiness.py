"""Compile-time proof that a constraint matches no string at all, so such a request is refused at
submission (GrammarError) instead of failing at its first sampled token.

A conservative check (it reports "empty" only when sure); any kind whose fresh matcher allows no
token and cannot end is refused by `compiler.check_nonempty`.
- `regex_is_empty`: walks Python's parse of the regex; a class like `[^\\s\\S]` (a category and
  its complement, negated) or a negative lookahead of the empty string matches nothing, and a
  sequence holding one such part is empty too. Regexes Python cannot parse are left to the backend.
- `ebnf_is_empty`: the root rule of an EBNF grammar derives no finite string (`root ::= a`,
  `a ::= "x" a`): the least fixpoint of "rule derives a finite string" over the grammar's rules.
  The backends compile such a grammar and serve its endless forced text (a truncated, invalid
  output), so it is refused here (issue 51).
- `schema_is_empty`: a JSON schema with no finite instance, e.g. an object whose required property
  refers back to the root: the same fixpoint over local `$ref` targets, where only what every
  instance needs counts (required properties of an object-only schema, allOf members, minItems of
  an array-only schema, any of anyOf / oneOf).
"""

from __future__ import annotations

import re
import warnings

from deepinfer.grammar.exactness import resolve_ref

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


# --- EBNF (GBNF as xgrammar reads it) --------------------------------------------------------

_EBNF_TOKEN = re.compile(r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<def>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<rep>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[()|*+?])
""", re.X | re.S)


class _Unsure(Exception):
    """A construct this analysis does not model: the grammar is reported non-empty."""


def _ebnf_tokens(text: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(text):
        m = _EBNF_TOKEN.match(text, i)
        if m is None:
            raise _Unsure(text[i:i + 20])
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        i = m.end()
    return out


def _ebnf_rules(text: str) -> dict[str, list]:
    """name -> token list of its body (a rule starts at `name ::=`)."""
    toks = _ebnf_tokens(text)
    rules: dict[str, list] = {}
    cur = None
    i = 0
    while i < len(toks):
        if i + 1 < len(toks) and toks[i][0] == "name" and toks[i + 1][0] == "def":
            cur = rules.setdefault(toks[i][1], [])
            if cur:  # a rule defined twice: leave it to the backend
                raise _Unsure(toks[i][1])
            i += 2
            continue
        if cur is None:
            raise _Unsure(toks[i][1])
        cur.append(toks[i])
        i += 1
    return rules


def _ebnf_expr(toks: list, i: int = 0):
    """Parse alternatives from toks[i]: (tree, next index). Trees: ("alt", [...]), ("seq", [...]),
    ("ref", name), ("lit",), ("opt", tree) for a repeat that may be absent, ("rep", tree) for one
    that needs at least one."""
    alts, seq = [], []
    while i < len(toks):
        kind, val = toks[i]
        if kind == "op" and val == "|":
            alts.append(("seq", seq))
            seq = []
            i += 1
            continue
        if kind == "op" and val == ")":
            break
        if kind == "op" and val == "(":
            sub, i = _ebnf_expr(toks, i + 1)
            if i >= len(toks) or toks[i][1] != ")":
                raise _Unsure("(")
            i += 1
            seq.append(sub)
        elif kind in ("str", "cls"):
            seq.append(("lit",))
            i += 1
        elif kind == "name":
            seq.append(("ref", val))
            i += 1
        elif kind in ("op", "rep") and val in "*+?" or kind == "rep":
            if not seq:
                raise _Unsure(val)
            if kind == "rep":
                lo = val[1:-1].split(",")[0].strip()
                optional = lo in ("", "0")
            else:
                optional = val in "*?"
            seq[-1] = ("opt" if optional else "rep", seq[-1])
            i += 1
        else:
            raise _Unsure(val)
    alts.append(("seq", seq))
    return ("alt", alts), i


def _derives(tree, live: set[str], rules) -> bool:
    tag = tree[0]
    if tag == "lit" or tag == "opt":
        return True
    if tag == "ref":
        if tree[1] not in rules:
            raise _Unsure(tree[1])  # an undefined rule: the backend reports it
        return tree[1] in live
    if tag == "rep":
        return _derives(tree[1], live, rules)
    if tag == "seq":
        return all(_derives(t, live, rules) for t in tree[1])
    return any(_derives(t, live, rules) for t in tree[1])  # alt


def ebnf_is_empty(text: str, root: str = "root") -> bool:
    """True when the EBNF grammar's root rule surely derives no finite string (False when unsure,
    e.g. a construct it does not model or a grammar the backend will reject anyway)."""
    try:
        rules = _ebnf_rules(text)
        if root not in rules:
            return False
        trees = {}
        for name, toks in rules.items():
            tree, end = _ebnf_expr(toks)
            if end != len(toks):
                return False
            trees[name] = tree
        live: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, tree in trees.items():
                if name not in live and _derives(tree, live, trees):
                    live.add(name)
                    changed = True
        return root not in live
    except (_Unsure, RecursionError):
        return False


# --- JSON schema ------------------------------------------------------------------------------

def _pointer(root, ref: str):
    """The local schema `ref` ("#", "#/$defs/a") points to; _Unsure for any other reference."""
    node = resolve_ref(root, ref)
    if node is None:
        raise _Unsure(ref)
    return node


def _only_type(schema: dict, name: str) -> bool:
    t = schema.get("type")
    return t == name or (isinstance(t, list) and t == [name])


def _has_instance(schema, root, live: set[str]) -> bool:
    """Whether schema has a finite instance, given the $ref targets known to (`live`); True
    whenever unsure (only what every instance needs can make it False)."""
    if schema is False:
        return False
    if not isinstance(schema, dict):
        return True
    if "const" in schema or "enum" in schema:
        return True  # a given value: checked elsewhere (exactness.check_spec)
    ref = schema.get("$ref")
    if ref is not None:
        _pointer(root, ref)  # unsure about anything but a local pointer
        if ref not in live:
            return False
    for sub in schema.get("allOf") or []:
        if not _has_instance(sub, root, live):
            return False
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        if isinstance(subs, list) and subs and not any(_has_instance(s, root, live) for s in subs):
            return False
    if _only_type(schema, "object"):
        props = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if isinstance(props, dict) and name in props and not _has_instance(props[name], root, live):
                return False
    if _only_type(schema, "array"):
        min_items = schema.get("minItems", 0)
        prefix = schema.get("prefixItems")
        if isinstance(prefix, list):
            if any(not _has_instance(s, root, live) for s in prefix[:min_items] if isinstance(min_items, int)):
                return False
        elif isinstance(min_items, int) and min_items > 0 and isinstance(schema.get("items"), (dict, bool)):
            if not _has_instance(schema["items"], root, live):
                return False
    return True


def _refs(schema, out: set[str]) -> None:
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str):
                out.add(v)
            elif k not in ("const", "enum", "default", "examples"):
                _refs(v, out)
    elif isinstance(schema, list):
        for v in schema:
            _refs(v, out)


def schema_is_empty(schema) -> bool:
    """True when the JSON schema surely has no finite instance (a required property that refers
    back to the root, a two-step cycle of required properties); False when unsure."""
    if not isinstance(schema, dict):
        return False
    try:
        refs: set[str] = set()
        _refs(schema, refs)
        if not refs:  # without a reference every schema here is finite: the backends judge the rest
            return False
        live: set[str] = set()
        changed = True
        while changed:
            changed = False
            for ref in refs - live:
                if _has_instance(_pointer(schema, ref), schema, live):
                    live.add(ref)
                    changed = True
        return not _has_instance(schema, schema, live)
    except (_Unsure, RecursionError):
        return False

