"""Small objects in any key order: an exact, bounded schema rewrite before the backends compile.

Every backend generates (and accepts) an object's properties only in their declared order, so a
valid document whose keys come in another order was refused: 16 of the 41 valid instances the
default grammar rejected on the JSONSchemaBench subsets (e.g. `{"shape": .., "dimensions": ..}`
against properties declared dimensions-then-shape). JSON objects are unordered, so an object
schema equals the anyOf of the same schema with its properties declared in each order: the
same valid documents, and the grammar accepts every key order. Bounded: only objects of 2 or 3
declared properties (at most 6 orders) without patternProperties or a schema-valued
additionalProperties, whose (already rewritten) text stays under MAX_OBJECT_CHARS, so nested
copies cannot blow up.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

MAX_PROPERTIES = 3
MAX_OBJECT_CHARS = 8000
_DATA = frozenset({"const", "enum", "default", "examples"})
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # name -> schema
# the only keywords a permuted object may hold (any other, e.g. an unknown container a $ref
# points into, keeps the object as it is)
_ALLOWED = frozenset({"type", "properties", "required", "additionalProperties", "minProperties", "maxProperties",
                      "title", "description", "$comment", "default", "examples", "$schema"})
# keywords whose meaning depends on where the schema sits (a copy would change what refs reach)
_UNSAFE = ('"$id"', '"$dynamicRef"', '"$recursiveRef"', '"$anchor"')


def any_order(schema: Any) -> Any:
    """schema with small object schemas accepting their keys in any order (the input itself when
    nothing changes or the schema uses location-dependent keywords)."""
    if not isinstance(schema, dict):
        return schema
    text = json.dumps(schema)
    if any(k in text for k in _UNSAFE):
        return schema
    out = _map(schema)
    return schema if out == schema else out


def _map(s: Any) -> Any:
    if isinstance(s, list):
        return [_map(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k in _DATA:
            out[k] = v
        elif k in _MAPS and isinstance(v, dict):  # a map of schemas, not a schema itself
            out[k] = {name: _map(sub) for name, sub in v.items()}
        else:
            out[k] = _map(v)
    return _permuted(out)


def _permuted(s: dict) -> dict:
    props = s.get("properties")
    if not isinstance(props, dict) or not 2 <= len(props) <= MAX_PROPERTIES:
        return s
    if s.get("type", "object") != "object" or not set(s) <= _ALLOWED:
        return s
    if "additionalProperties" in s and s["additionalProperties"] is not False:
        return s
    if len(json.dumps(s)) > MAX_OBJECT_CHARS:
        return s
    rest = {k: v for k, v in s.items() if k not in ("properties", "type", "$schema", "title", "description")}
    branches = [{"type": "object", **rest, "properties": {k: props[k] for k in order}}
                for order in itertools.permutations(props)]
    out: dict[str, Any] = {"anyOf": branches}
    for k in ("$schema", "title", "description"):  # annotations stay once, at the top
        if k in s:
            out[k] = s[k]
    return out
