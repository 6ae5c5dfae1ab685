"""What a compiled JSON-schema grammar enforces, and specs no backend may serve.

Exactness: every backend has a table of the schema keywords it enforces exactly (each entry is
tested against the backend in tests/grammar/test_exactness.py). A validation keyword of the
schema that is not in the table is reported as approximated, and so is anything the backend's
own diagnostics say it approximated (xgrammar's warnings, llguidance's warnings). An exact
grammar only accepts documents that validate; an approximated one may accept invalid ones, so
its outputs are validated when they finish (deepinfer.grammar.validate).

Invalid specs: `check_spec` refuses, before any backend sees it, a schema that is not a valid
JSON Schema or contains a local contradiction (an empty enum, minimum > maximum, `not: {}`,
allOf branches with no common type, ...) where every instance must satisfy it, raising
InvalidSpecError: the fallback stops there.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Iterator

from deepinfer.errors import InvalidSpecError
from deepinfer.grammar.spec import GrammarSpec

# Keywords that constrain instances (annotations such as title/description/default/examples,
# and the containers $defs/definitions, never do).
VALIDATION_KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
    "dependencies", "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
    "contains", "minContains", "maxContains", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf",
    "allOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
    "unevaluatedProperties", "unevaluatedItems", "contentSchema",
    # draft 3's own (jsonschema's Draft3Validator enforces them; no backend knows them: found as an
    # exact grammar accepting 3 for {"$schema": draft-03, "divisibleBy": 2})
    "divisibleBy", "disallow", "extends",
})

# Formats each backend's grammar enforces at least as strictly as jsonschema's FormatChecker.
# Not "date"/"date-time" (the grammars accept 2024-02-30) nor the IP formats (leading zeros);
# "date" is lowered to an exact pattern before any backend sees it (formats.py).
EXACT_FORMATS = frozenset({"email", "uuid"})

_COMMON_EXACT = frozenset({
    "type", "enum", "const", "properties", "required", "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format", "anyOf", "$ref",
})

#: keyword -> enforced exactly, per backend. Context-dependent weak spots (xgrammar: oneOf with
#: overlapping branches, allOf with several branches, pattern/format with length bounds, anchors
#: inside a pattern) come from the backend's own warnings, see diagnostics_keywords.
EXACT_KEYWORDS: dict[str, frozenset[str]] = {
    # not allOf: what lowering.py cannot merge stays an allOf, and xgrammar silently drops such a
    # branch ("a" accepted for {"pattern": "^a", "allOf": [{"pattern": "b$"}]}; {"b": 1} for an
    # additionalProperties-false parent whose allOf branch declares b); several branches it warns about
    "xgrammar": _COMMON_EXACT | {
        "additionalProperties", "patternProperties", "propertyNames", "minProperties", "maxProperties",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "oneOf",
        "unevaluatedProperties",
    },
    # llguidance refuses the keywords it does not implement, so its table is what it compiles
    "llguidance": _COMMON_EXACT | {
        "additionalProperties", "patternProperties", "minProperties", "maxProperties", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "allOf",
    },
    # outlines-core's regexes ignore numeric bounds, maxProperties and most combinators
    "outlines": _COMMON_EXACT | {"additionalProperties", "minProperties"},
}

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
               "else", "unevaluatedProperties", "unevaluatedItems", "contentSchema")


def subschemas(schema: Any) -> Iterator[dict]:
    """Every object (sub)schema of schema, itself first."""
    if not isinstance(schema, dict):
        return
    yield schema
    for k in _SCHEMA_MAPS:
        v = schema.get(k)
        if isinstance(v, dict):
            for sub in v.values():
                yield from subschemas(sub)
    for k in _SCHEMA_LISTS:
        v = schema.get(k)
        if isinstance(v, list):
            for sub in v:
                yield from subschemas(sub)
    for k in _SCHEMA_ONE:
        yield from subschemas(schema.get(k))
    items = schema.get("items")
    for sub in items if isinstance(items, list) else [items]:
        yield from subschemas(sub)
    deps = schema.get("dependencies")
    if isinstance(deps, dict):
        for sub in deps.values():
            yield from subschemas(sub)


#: reported for a draft-03 schema: its `required: true`, `type` holding schemas, `divisibleBy`,
#: `extends` and `disallow` mean what no backend implements (they compile draft 4+ meanings)
DRAFT3 = "$schema (draft-03)"
#: a non-integral multipleOf: jsonschema divides binary floats (0.3 / 0.1 = 2.9999999999999996, so
#: 0.3 is not a multiple of 0.1 there), llguidance decides in decimal (0.3 is): the two disagree
FLOAT_MULTIPLE = "multipleOf (non-integer)"
#: an exclusive bound on a non-integer number: the validator compares the instance's nearest double
#: (0.09999999999999999999 reads as 0.1, so it fails exclusiveMaximum 0.1), the grammars compare the
#: decimal text (it is below 0.1); a bound past 2**53 is not a double itself either
FLOAT_BOUND = "{} (float)"
_EXACT_DOUBLE = 2**53


def _draft(schema: Any) -> str:
    """The root's draft as jsonschema reads its $schema ("2020-12" when absent or unknown)."""
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    if not isinstance(uri, str):
        return "2020-12"
    for name in ("draft-03", "draft-04", "draft-06", "draft-07", "2019-09"):
        if name in uri:
            return name
    return "2020-12"


def _admits_fractions(s: dict) -> bool:
    """Whether s's type lets a number with a fraction through (no type, or "number")."""
    t = s.get("type")
    ts = set(t) if isinstance(t, list) else {t} if t is not None else None
    return ts is None or "number" in ts


def _numeric_context(s: dict) -> set[str]:
    """The numeric keywords of one subschema whose meaning depends on float arithmetic (see
    FLOAT_MULTIPLE / FLOAT_BOUND)."""
    out: set[str] = set()
    m = s.get("multipleOf")
    if _num(m) and not float(m).is_integer():
        out.add(FLOAT_MULTIPLE)
    if not _admits_fractions(s):
        return out
    for k in ("exclusiveMinimum", "exclusiveMaximum"):
        v = s.get(k)
        if v is True or _num(v):  # draft 4's boolean form makes minimum/maximum exclusive
            out.add(FLOAT_BOUND.format(k))
    for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        v = s.get(k)
        if _num(v) and abs(v) > _EXACT_DOUBLE:
            out.add(FLOAT_BOUND.format(k))
    return out


def keywords_used(schema: Any) -> set[str]:
    """The validation keywords schema uses anywhere ("format" only for formats outside EXACT_FORMATS
    counts as "format:<name>"), plus the contexts no backend enforces as the validator does: a
    draft-03 schema (DRAFT3) and float arithmetic (FLOAT_MULTIPLE, FLOAT_BOUND)."""
    used: set[str] = set()
    if _draft(schema) == "draft-03":
        used.add(DRAFT3)
    for s in subschemas(schema):
        for k in s:
            if k not in VALIDATION_KEYWORDS:
                continue
            if k == "format" and s[k] not in EXACT_FORMATS:
                used.add(f"format:{s[k]}")
            else:
                used.add(k)
        used |= _numeric_context(s)
    return used


def _negated_classes(pattern: str) -> list[str]:
    """The bodies of the negated character classes (`[^...]`) of a regex, as written."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            j = i + 1
            neg = pattern.startswith("^", j)
            j += neg
            if pattern.startswith("]", j):  # a leading ] is literal
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            if neg:
                out.append(pattern[i + 2 : j])
            i = j + 1
            continue
        i += 1
    return out


# the two characters a JSON string writes escaped (\" and \\), as a regex class may spell them
_QUOTE_OR_BACKSLASH = ('"', "\\\\", "x22", "x5c", "x5C", "u0022", "u005c", "u005C")
# what can match a backslash of the JSON text itself (a negated class, a dot, \W \S \D)
_MATCHES_RAW_ESCAPES = re.compile(r"\[\^|(?<!\\)\.|\\[WSD]")


def _pattern_context(backend: str, pattern: str) -> bool:
    """Whether a backend's grammar for this pattern lets through a JSON escape the pattern refuses
    once decoded. llguidance: a negated class that excludes `"` or `\\` (`^[^"]*$` accepted
    "a\\"b", which decodes to a"b; `[^x]` or `[^\\s"]` are enforced). outlines-core matches the JSON
    text, escapes undecoded: `^[^a]+$` accepted "\\u0061"."""
    if backend == "llguidance":
        return any(q in body for body in _negated_classes(pattern) for q in _QUOTE_OR_BACKSLASH)
    if backend == "outlines":
        return bool(_MATCHES_RAW_ESCAPES.search(pattern))
    return False


def _shadowed_properties(s: dict) -> bool:
    """Whether a declared property name also matches one of the object's patternProperties (its
    value must then satisfy both; xgrammar applies only the property's schema: {"ab": 1} accepted
    for properties ab: integer and patternProperties ^a: minimum 5)."""
    props, pats = s.get("properties"), s.get("patternProperties")
    if not isinstance(props, dict) or not isinstance(pats, dict) or not props or not pats:
        return False
    for p in pats:
        try:
            rx = re.compile(p)
        except (re.error, TypeError):
            return True  # cannot tell: count it
        if any(rx.search(name) for name in props):
            return True
    return False


# what xgrammar (and outlines) keep beside anyOf/oneOf: the branches themselves, refs, and `type` (it narrows them)
_BESIDE_BRANCHES_OK = frozenset({"anyOf", "oneOf", "type", "$ref"})


def _context_approximated(backend: str, schema: Any) -> set[str]:
    """Keywords a backend approximates only in some contexts it does not warn about."""
    out: set[str] = set()
    for s in subschemas(schema):
        if isinstance(s.get("pattern"), str) and _pattern_context(backend, s["pattern"]):
            out.add("pattern")
        pats = s.get("patternProperties")
        if isinstance(pats, dict) and any(_pattern_context(backend, p) for p in pats):
            out.add("patternProperties")
        if backend == "xgrammar" and _shadowed_properties(s):
            out.add("patternProperties")
        if backend in ("xgrammar", "outlines") and any(isinstance(s.get(k), list) for k in ("anyOf", "oneOf")):
            # keywords beside anyOf/oneOf are dropped when the branches give the type: {} accepted
            # for {"minProperties": 1, "anyOf": [{"type": "string"}, {"$ref": <object>}]}
            # (JsonSchemaStore resjson.json, 3 invalid instances)
            out |= {k for k in s if k in VALIDATION_KEYWORDS and k not in _BESIDE_BRANCHES_OK}
    if backend in ("xgrammar", "outlines"):
        # from 2019-09 on, keywords beside a $ref apply too; xgrammar follows the ref and drops them
        # (it accepted {"a": 5} for {"$ref": <integer>, "maximum": 3}); up to draft 7 jsonschema
        # ignores them as well
        siblings_apply = _draft(schema) in ("2019-09", "2020-12")
        for s in subschemas(schema):
            if siblings_apply and "$ref" in s and any(k in VALIDATION_KEYWORDS for k in s if k != "$ref"):
                out.add("$ref")
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            req = s.get("required")
            # a required name with no property schema is not enforced (measured on JSONSchemaBench)
            if isinstance(req, list) and any(isinstance(r, str) and r not in props for r in req):
                out.add("required")
    return out


def table_approximated(backend: str, schema: Any) -> list[str]:
    """Keywords of schema that the backend's table does not list as exact (sorted)."""
    exact = EXACT_KEYWORDS.get(backend)
    used = keywords_used(schema)
    if exact is None:  # a backend without a table: nothing is known to be exact
        return sorted(used)
    return sorted({k for k in used if k not in exact} | _context_approximated(backend, schema))


def strict_narrowing(schema: Any) -> list[str]:
    """What strict mode narrows in schema (sorted): "additionalProperties (strict)" when an object
    subschema leaves additionalProperties unset (undeclared keys are then refused, JSON Schema
    allows them), "items (strict)" when a tuple (prefixItems, or items as a list) leaves the
    items after it unset. Not approximations: every accepted document still validates."""
    out: set[str] = set()
    for s in subschemas(schema):
        if (s.get("type") == "object" or isinstance(s.get("properties"), dict)) and \
                "additionalProperties" not in s and "unevaluatedProperties" not in s:
            out.add("additionalProperties (strict)")
        tuple_form = isinstance(s.get("prefixItems"), list) and "items" not in s
        draft4_tuple = isinstance(s.get("items"), list) and "additionalItems" not in s
        if (tuple_form or draft4_tuple) and "unevaluatedItems" not in s:
            out.add("items (strict)")
    return sorted(out)


_DIAGNOSTIC_KEYWORDS = (
    (re.compile(r"\boneOf\b"), ("oneOf",)),
    (re.compile(r"\ballOf\b"), ("allOf",)),
    (re.compile(r"ignoring minLength/maxLength"), ("minLength", "maxLength")),
    (re.compile(r"[Aa]nchor"), ("pattern",)),
    (re.compile(r"\bmultipleOf\b"), ("multipleOf",)),
    (re.compile(r"\bformat\b"), ("format",)),
)


def diagnostics_keywords(messages: Iterable[str]) -> list[str]:
    """The keywords a backend's warnings say it approximated; a warning naming none is kept as
    "warning: <text>" (not knowing what it means, we cannot call the grammar exact)."""
    out: list[str] = []
    for msg in messages:
        hit = False
        for rx, kws in _DIAGNOSTIC_KEYWORDS:
            if rx.search(msg):
                out.extend(kws)
                hit = True
        if not hit and msg.strip():
            out.append("warning: " + msg.strip()[:160])
    return sorted(set(out))


# ---- invalid / unsatisfiable specs ----------------------------------------------------------

_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
           ("minContains", "maxContains"))


def _types_of(s: dict) -> set[str] | None:
    """The instance types s allows by its `type` (None = any); integer is within number."""
    t = s.get("type")
    if t is None:
        return None
    ts = set(t) if isinstance(t, list) else {t}
    if "number" in ts:
        ts.add("integer")
    return ts


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def contradiction(s: dict) -> str | None:
    """A local contradiction of one schema object (it admits no instance), or None."""
    if "enum" in s and isinstance(s["enum"], list) and not s["enum"]:
        return "enum is empty"
    if "not" in s and (s["not"] is True or s["not"] == {}):
        return "`not` of a schema that accepts everything"
    t = s.get("type")
    if isinstance(t, list) and not t:
        return "type is an empty list"
    for lo, hi in _BOUNDS:
        if _num(s.get(lo)) and _num(s.get(hi)) and s[lo] > s[hi]:
            return f"{lo} ({s[lo]}) is greater than {hi} ({s[hi]})"
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if _num(lo) and _num(hi) and lo > hi:
        return f"minimum ({lo}) is greater than maximum ({hi})"
    for a, b, name in ((xlo, hi, "exclusiveMinimum >= maximum"), (lo, xhi, "minimum >= exclusiveMaximum"),
                       (xlo, xhi, "exclusiveMinimum >= exclusiveMaximum")):
        if _num(a) and _num(b) and a >= b:
            return f"{name} ({a}, {b})"
    types = _types_of(s)
    if types is not None and types <= {"integer"} and (_num(lo) or _num(xlo)) and (_num(hi) or _num(xhi)):
        import math

        low = math.floor(xlo) + 1 if _num(xlo) else math.ceil(lo)
        if _num(lo) and _num(xlo):
            low = max(low, math.ceil(lo))
        high = math.ceil(xhi) - 1 if _num(xhi) else math.floor(hi)
        if _num(hi) and _num(xhi):
            high = min(high, math.floor(hi))
        if low > high:
            return "no integer lies within the bounds"
    if types is not None:
        for k in ("enum", "const"):
            vals = s.get(k) if k == "enum" else [s[k]] if k in s else None
            if isinstance(vals, list) and vals and not any(_json_type(v) in types or
                                                           (_json_type(v) == "integer" and "number" in types)
                                                           for v in vals):
                return f"no {k} value has the declared type {s.get('type')!r}"
    branches = s.get("allOf")
    if isinstance(branches, list):
        common = _types_of(s)
        for b in branches:
            if b is False:
                return "allOf has a `false` branch"
            bt = _types_of(b) if isinstance(b, dict) else None
            if bt is not None:
                common = bt if common is None else common & bt
        if common is not None and not common:
            return "allOf branches have no type in common"
    return None


def resolve_ref(root: Any, ref: Any) -> Any:
    """The target of a local $ref ("#/a/b"), None when not local or not found."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def first_contradiction(schema: Any, root: Any = None, seen: set[int] | None = None) -> str | None:
    """Why schema admits no instance, looking only where every instance must satisfy a subschema
    (the schema itself, its allOf branches and local $refs, required properties, the first minItems
    items, and anyOf/oneOf when every branch fails); None when no contradiction is found.
    Elsewhere (an optional property, inside `not`) an unsatisfiable subschema is a legitimate
    idiom, e.g. `"properties": {"x": {"not": {}}}` forbids the key x."""
    root = schema if root is None else root
    seen = set() if seen is None else seen
    if schema is False:
        return "`false` accepts no value"
    if not isinstance(schema, dict) or id(schema) in seen:
        return None
    seen.add(id(schema))
    why = contradiction(schema)
    if why is not None:
        return why
    children: list[Any] = []
    if "$ref" in schema:
        children.append(resolve_ref(root, schema["$ref"]))
    if isinstance(schema.get("allOf"), list):
        children.extend(schema["allOf"])
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    for name in schema.get("required") or []:
        if isinstance(name, str) and name in props:
            children.append(props[name])
    n_min = schema.get("minItems") if _num(schema.get("minItems")) else 0
    if n_min:
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        items = schema.get("items")
        if isinstance(items, list):  # draft-4 tuple form
            prefix, items = items, schema.get("additionalItems")
        children.extend(prefix[:n_min])
        if n_min > len(prefix) and items is not None:
            children.append(items)
    for child in children:
        why = first_contradiction(child, root, seen)
        if why is not None:
            return why
    for k in ("anyOf", "oneOf"):
        branches = schema.get(k)
        if isinstance(branches, list) and branches:
            whys = [first_contradiction(b, root, set(seen)) for b in branches]
            if all(w is not None for w in whys):
                return f"every {k} branch is unsatisfiable ({whys[0]})"
    return None


def check_schema(schema: Any) -> None:
    """Raise InvalidSpecError if schema is not a valid JSON Schema (per its $schema draft, default
    2020-12) or cannot accept any instance (see first_contradiction)."""
    try:
        import jsonschema
    except ImportError:  # without jsonschema only the contradiction check runs
        jsonschema = None
    if jsonschema is not None and not isinstance(schema, bool):
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.path) or "(root)"
            raise InvalidSpecError(f"invalid JSON schema at {where}: {e.message}") from None
    why = first_contradiction(schema)
    if why is not None:
        raise InvalidSpecError(f"unsatisfiable JSON schema: {why}")


def check_spec(spec: GrammarSpec) -> None:
    """Refuse specs that are invalid whatever the backend (InvalidSpecError)."""
    if spec.kind == "json_schema":
        check_schema(json.loads(spec.text))


def schema_of(spec: GrammarSpec) -> Any:
    """The schema object of a JSON spec (None for other kinds)."""
    if spec.kind in ("json_schema", "json_object"):
        return json.loads(spec.text)
    return None
