"""Strict mode as a schema rewrite, for backends without one (llguidance).

xgrammar's strict mode refuses undeclared properties and tuple items past the declared prefix: a
deliberate narrowing (every accepted document still validates) that keeps a model on the declared
fields. llguidance has no such option, so `strict_schema` writes it into the schema:
`"additionalProperties": false` on object schemas that declare properties, `"items": false` after
a `prefixItems` tuple.

Narrowing a subschema only shrinks the language where that subschema is the whole constraint on
its value. Under `not` it would widen the language (an invalid document would be accepted), under
`oneOf` it can make a document match one branch instead of two (again wider), and under `allOf`,
beside sibling `properties`, applicators or `$ref`s, the keys another schema declares would become
forbidden (refusing valid documents, or leaving no instance at all). So the rewrite is made only in
positions where the subschema alone constrains the value: the root, property / item / prefixItems /
additionalProperties values of a narrowable schema, anyOf branches of a parent that holds nothing
else, and `$defs` / `definitions` entries every one of whose `$ref` sites is such a position. Refs
it cannot place (anything but `#/$defs/<name>` / `#/definitions/<name>`, `$id`, dynamic refs) leave
the schema as it is. Objects that would become unsatisfiable (a required key not declared,
minProperties above the declared count, minItems past the prefix) keep their extra keys.
"""

from __future__ import annotations

import re
from typing import Any

ADDITIONAL_PROPERTIES = "additionalProperties (strict)"
ITEMS = "items (strict)"

_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "deprecated", "readOnly",
                          "writeOnly", "$schema"})
_DATA = frozenset({"const", "enum", "default", "examples"})
# keywords that combine another schema with this one for the same value
_APPLICATORS = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "dependentSchemas",
                          "dependencies", "dependentRequired", "unevaluatedProperties", "unevaluatedItems",
                          "$dynamicRef", "$recursiveRef"})
# a parent whose anyOf branches are each the whole schema of the value
_ANYOF_PARENT = _ANNOTATIONS | {"anyOf", "type", "$defs", "definitions"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
               "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_LOCAL_DEF = re.compile(r"^#/(\$defs|definitions)/([^/]+)$")
_UNPLACEABLE = ("$id", "$anchor", "$dynamicRef", "$recursiveRef", "$dynamicAnchor", "$recursiveAnchor")


class _Unplaceable(Exception):
    """A ref or keyword whose target the rewrite cannot follow: leave the schema alone."""


def _def_key(ref: Any) -> tuple[str, str]:
    m = _LOCAL_DEF.match(ref) if isinstance(ref, str) else None
    if m is None:
        raise _Unplaceable
    return m.group(1), m.group(2).replace("~1", "/").replace("~0", "~")


def _child_ok(s: dict, ok: bool, k: str) -> bool:
    """Whether the subschemas under keyword k of s (narrowable iff ok) may be narrowed: each must be
    the only schema its value meets."""
    alone = ok and not (_APPLICATORS & set(s)) and "contains" not in s
    if k == "properties":  # a key matching a pattern meets the pattern's schema too
        return alone and "patternProperties" not in s
    if k == "patternProperties":
        return alone and "properties" not in s and isinstance(s[k], dict) and len(s[k]) <= 1
    if k in ("prefixItems", "items", "additionalItems", "additionalProperties"):
        return alone
    if k == "anyOf":
        return ok and set(s) <= _ANYOF_PARENT
    return False  # allOf, oneOf, not, if/then/else, contains, dependentSchemas, ...


def _children(s: dict, ok: bool) -> list[tuple[Any, bool]]:
    """(subschema, narrowable) for every subschema directly under s, s being narrowable iff ok
    (root definitions are not among them: they are narrowed by their ref sites)."""
    out: list[tuple[Any, bool]] = []
    for k, v in s.items():
        if k in _DATA or k in ("$defs", "definitions"):
            continue
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out += [(sub, _child_ok(s, ok, k)) for sub in v.values()]
        elif (k in _SCHEMA_LISTS or k == "items") and isinstance(v, list):
            out += [(sub, _child_ok(s, ok, k)) for sub in v]
        elif k in _SCHEMA_ONE or k == "items":
            out.append((v, _child_ok(s, ok, k)))
        elif k == "dependencies" and isinstance(v, dict):
            out += [(sub, False) for sub in v.values() if isinstance(sub, dict)]
    return out


def _ref_sites(s: Any, ok: bool, sites: dict[tuple[str, str], bool]) -> None:
    """Record, per local definition, whether every ref to it seen so far sits where it may be narrowed."""
    if not isinstance(s, dict):
        return
    if any(k in s for k in _UNPLACEABLE) or isinstance(s.get("id"), str):  # base URI changes (draft 4: "id")
        raise _Unplaceable
    if "$ref" in s:
        key = _def_key(s["$ref"])
        standalone = ok and not ({k for k in s if k not in _ANNOTATIONS} - {"$ref", "$defs", "definitions"})
        sites[key] = sites.get(key, True) and standalone
    for sub, sub_ok in _children(s, ok):
        _ref_sites(sub, sub_ok, sites)


def _narrowable_defs(schema: dict) -> dict[tuple[str, str], bool]:
    """Which root definitions may be narrowed: every ref to them, from the root or from a narrowable
    definition, sits in a narrowable position (a fixpoint: unmarking one can unmark the ones it refs)."""
    defs = {(c, n): sub for c in ("$defs", "definitions") if isinstance(schema.get(c), dict)
            for n, sub in schema[c].items()}
    ok = {k: True for k in defs}
    while True:
        sites: dict[tuple[str, str], bool] = {}
        # the root's own base URI ($id / draft 4's id) is where the local refs resolve anyway
        _ref_sites({k: v for k, v in schema.items() if k not in ("$id", "id")}, True, sites)
        for k, sub in defs.items():
            _ref_sites(sub, ok[k], sites)
        if any(k not in defs for k in sites):
            raise _Unplaceable  # a ref to a definition that is not there
        new = {k: ok[k] and sites.get(k, True) for k in defs}
        if new == ok:
            return ok
        ok = new


def _narrow(s: Any, ok: bool, done: set[str]) -> Any:
    """s with strict mode written in where it is narrowable (ok), and below; done collects what."""
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    for k, v in s.items():
        if k in _DATA or k in ("$defs", "definitions"):  # data; definitions: by their ref sites
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            sub_ok = _child_ok(s, ok, k)
            out[k] = {n: _narrow(x, sub_ok, done) for n, x in v.items()}
        elif (k in _SCHEMA_LISTS or k == "items") and isinstance(v, list):
            sub_ok = _child_ok(s, ok, k)
            out[k] = [_narrow(x, sub_ok, done) for x in v]
        elif k in _SCHEMA_ONE or k == "items":
            out[k] = _narrow(v, _child_ok(s, ok, k), done)
        else:  # type, required, bounds, dependencies (never narrowed), unknown keywords
            out[k] = v
    if not ok or _APPLICATORS & set(s):
        return out
    props = s.get("properties")
    if isinstance(props, dict) and props and "additionalProperties" not in s:
        required = s.get("required") if isinstance(s.get("required"), list) else []
        n_min = s.get("minProperties", 0)
        # a required key it does not declare, or more keys than it declares, would leave no instance
        if all(r in props for r in required) and (not isinstance(n_min, int) or n_min <= len(props)):
            out["additionalProperties"] = False
            done.add(ADDITIONAL_PROPERTIES)
    prefix = s.get("prefixItems")
    if isinstance(prefix, list) and "items" not in s and "contains" not in s:
        n_min = s.get("minItems", 0)
        if not isinstance(n_min, int) or n_min <= len(prefix):
            out["items"] = False
            done.add(ITEMS)
    return out


def strict_schema(schema: Any) -> tuple[Any, list[str]]:
    """(schema with strict mode written in, what was narrowed: ADDITIONAL_PROPERTIES / ITEMS);
    (schema itself, []) when nothing could be narrowed safely."""
    if not isinstance(schema, dict):
        return schema, []
    try:
        defs_ok = _narrowable_defs(schema)
    except _Unplaceable:
        return schema, []
    done: set[str] = set()
    out = _narrow(schema, True, done)
    for c in ("$defs", "definitions"):
        if isinstance(schema.get(c), dict):
            out[c] = {n: _narrow(sub, defs_ok[(c, n)], done) for n, sub in schema[c].items()}
    if not done:
        return schema, []
    return out, sorted(done)
