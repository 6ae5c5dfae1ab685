"""Exact schema-to-schema lowerings applied before the backends compile a JSON schema.

Each rewrite gives a schema that accepts exactly the same instances under JSON Schema semantics,
in a shape the backends enforce better (measured on JSONSchemaBench, see benchmarks/grammar_coverage.py):

- `const` / `enum` next to other keywords: the instance can only be one of the listed values, so
  the schema becomes the values that validate against the whole schema (xgrammar ignored the
  other keywords' contradictions, e.g. a `not` it approximates, and rejected the valid value).
  Object and array values become the schema of exactly that value (xgrammar matched them only
  in its own compact spelling).
- `allOf` merged into its parent where the branches' keywords do not interact (required lists
  joined, bounds tightened, property schemas combined per name ...): xgrammar approximates
  allOf with several branches and then ignored the parent's maxProperties and additionalProperties.
- `oneOf` of object branches: the parent's object keywords are distributed into each branch, so a
  branch is a full object schema, and the branches are made pairwise disjoint, after which oneOf is
  anyOf (which the backends enforce; xgrammar reads oneOf as anyOf and let through documents that
  match two branches). Branches are disjoint when a key both require has disjoint const/enum
  values; branches that only add `required` are made disjoint by forbidding, in branch i, one
  key of every other branch's extra required keys (one variant per choice, bounded).

- keys an object names in `required` / `dependencies` but does not declare get the schema `{}`
  (where additionalProperties is absent): xgrammar's strict mode forbade them.
- an allOf branch that is only a `$ref` to a definition without refs of its own is inlined first.

A rewrite that cannot be proved exact is not made: the schema keeps its keyword and the backend's
exactness table reports it approximated. Schemas with `$id`, dynamic/recursive refs or refs into
anything but `#/definitions` / `#/$defs` are left alone (moving subschemas would change what
such refs point at).
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any, Callable

from deepinfer.errors import InvalidSpecError

ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "deprecated", "readOnly",
                         "writeOnly", "$schema"})
MAX_ONEOF_VARIANTS = 32  # anyOf branches one oneOf may expand to (key-forbidding variants)

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
        "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_MIN = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_MAX = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
# keywords that read their siblings: merged only when the other side has none of the group
_GROUPS = (
    frozenset({"if", "then", "else"}),
    frozenset({"items", "prefixItems", "additionalItems", "unevaluatedItems"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"unevaluatedProperties"}),
)


class _Unmergeable(Exception):
    pass


def lower_schema(schema: Any) -> Any:
    """schema with the exact rewrites above applied (a copy; the input itself when nothing
    changes). Raises InvalidSpecError when the root's const/enum admits no value."""
    if not isinstance(schema, dict) or not _safe_refs(schema):
        return schema
    cls = _validator_class(schema)
    out = _map(copy.deepcopy(schema), lambda s: _lower_one(s, cls, schema))
    out = _structural_values(_collapse_values(out, cls, root=True))
    return schema if out == schema else out


# ---- walking ----------------------------------------------------------------------------------

def _map(s: Any, fn: Callable[[dict], dict]) -> Any:
    """Apply fn to every subschema object, children first."""
    if not isinstance(s, dict):
        return s
    for k in _MAPS:
        if isinstance(s.get(k), dict):
            s[k] = {n: _map(v, fn) for n, v in s[k].items()}
    for k in _LISTS:
        if isinstance(s.get(k), list):
            s[k] = [_map(v, fn) for v in s[k]]
    for k in _ONE:
        if k in s:
            s[k] = _map(s[k], fn)
    if isinstance(s.get("items"), list):
        s["items"] = [_map(v, fn) for v in s["items"]]
    elif "items" in s:
        s["items"] = _map(s["items"], fn)
    if isinstance(s.get("dependencies"), dict):
        s["dependencies"] = {n: _map(v, fn) for n, v in s["dependencies"].items()}
    return fn(s)


def _walk(s: Any):
    if isinstance(s, dict):
        yield s
        for v in s.values():
            yield from _walk(v)
    elif isinstance(s, list):
        for v in s:
            yield from _walk(v)


def _safe_refs(schema: dict) -> bool:
    for s in _walk(schema):
        if any(k in s for k in ("$id", "id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef")):
            return False
        ref = s.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (
                ref == "#" or ref.startswith("#/definitions/") or ref.startswith("#/$defs/"))):
            return False
    return True


def _has_ref(s: Any) -> bool:
    return any("$ref" in x for x in _walk(s))


def _lower_one(s: dict, cls: Any, root: dict) -> dict:
    if isinstance(s.get("allOf"), list) and "$ref" not in s:
        s = _merge_allof(s, root)
    if isinstance(s.get("oneOf"), list) and "$ref" not in s:
        s = _distribute_oneof(s)
    s = _declare_named_keys(s)
    return _structural_values(_collapse_values(s, cls, root=False))


def _declare_named_keys(s: dict) -> dict:
    """Keys an object schema names (required, dependencies) but does not declare get the schema
    `{}`: the same language while additionalProperties is absent, and the backends then know
    them (xgrammar's strict mode forbade them, and did not enforce a required undeclared name)."""
    if not (s.get("type") == "object" or isinstance(s.get("properties"), dict)):
        return s
    if any(k in s for k in ("additionalProperties", "unevaluatedProperties", "$ref")):
        return s
    names: list[str] = [n for n in s.get("required") or [] if isinstance(n, str)]
    for k in ("dependencies", "dependentRequired"):
        deps = s.get(k)
        if isinstance(deps, dict):
            for n, v in deps.items():
                names.append(n)
                if isinstance(v, list):
                    names += [x for x in v if isinstance(x, str)]
    props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
    missing = [n for n in dict.fromkeys(names) if n not in props]
    if not missing or not isinstance(s.get("properties", {}), dict):
        return s
    out = dict(s)
    out["properties"] = {**props, **{n: {} for n in missing}}
    return out


def _resolve(root: dict, ref: str) -> Any:
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _validator_class(schema: dict) -> Any:
    """The jsonschema validator class of the root's draft (None without jsonschema)."""
    try:
        import jsonschema
    except ImportError:
        return None
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


# ---- const / enum ----------------------------------------------------------------------------

def _collapse_values(s: Any, cls: Any, root: bool) -> Any:
    """A schema with const/enum and other keywords -> the values that validate against all of it
    (cls: the root's validator class). Nested subschemas only when they hold no $ref (they are
    validated on their own)."""
    if not isinstance(s, dict) or cls is None:
        return s
    if "const" in s:
        values, key = [s["const"]], "const"
    elif isinstance(s.get("enum"), list):
        values, key = s["enum"], "enum"
    else:
        return s
    others = [k for k in s if k not in ANNOTATIONS and k not in (key, "$defs", "definitions")]
    if not others or (not root and _has_ref(s)):
        return s
    v = cls(s, format_checker=cls.FORMAT_CHECKER)
    try:
        keep = [x for x in values if v.is_valid(x)]
    except Exception:  # a schema jsonschema cannot evaluate: leave it to the backends
        return s
    if not keep:
        if root:
            raise InvalidSpecError(f"unsatisfiable JSON schema: no {key} value satisfies the rest of the schema")
        return s
    out = {k: s[k] for k in s if k in ANNOTATIONS}
    if key == "const":
        out["const"] = keep[0]
    else:
        out["enum"] = keep
    return out


def _structural_values(s: dict) -> dict:
    """const/enum with object or array values as the schema of exactly those values (xgrammar
    matched such a const only in its own compact spelling, rejecting `{"a": 1}`)."""
    values = [s["const"]] if "const" in s else s.get("enum")
    if not isinstance(values, list) or not any(isinstance(v, (dict, list)) for v in values):
        return s
    if any(k not in ANNOTATIONS and k not in ("const", "enum") for k in s):
        return s  # other keywords too: left to the backends (and collapsed first where possible)
    out = {k: v for k, v in s.items() if k in ANNOTATIONS}
    scalars = [v for v in values if not isinstance(v, (dict, list))]
    alts = [value_schema(v) for v in values if isinstance(v, (dict, list))] + ([{"enum": scalars}] if scalars else [])
    if len(alts) == 1:
        out.update(alts[0])
    else:
        out["anyOf"] = alts
    return out


def value_schema(v: Any) -> Any:
    """A schema accepting exactly the JSON value v (objects with v's keys in v's order)."""
    if isinstance(v, dict):
        return {"type": "object", "properties": {k: value_schema(x) for k, x in v.items()}, "required": list(v),
                "additionalProperties": False}
    if isinstance(v, list):
        return {"type": "array", "prefixItems": [value_schema(x) for x in v], "minItems": len(v),
                "maxItems": len(v)}
    return {"const": v}


# ---- allOf ---------------------------------------------------------------------------------

def _merge_allof(s: dict, root: dict) -> dict:
    target = {k: v for k, v in s.items() if k != "allOf"}
    left = []
    for b in s["allOf"]:
        if b is True or b == {}:
            continue
        if isinstance(b, dict) and isinstance(b.get("$ref"), str) and b["$ref"] != "#" and \
                not {k for k in b if k not in ANNOTATIONS} - {"$ref"}:
            # a branch that is only a ref to a definition without refs of its own: that definition
            target_def = _resolve(root, b["$ref"])
            if isinstance(target_def, dict) and not _has_ref(target_def):
                b = copy.deepcopy(target_def)
        try:
            target = merge_schemas(target, b)
        except _Unmergeable:
            left.append(b)
    if left:
        target["allOf"] = left
    return target


def merge_schemas(a: dict, b: Any) -> dict:
    """One schema equal to allOf [a, b] (a new dict), or _Unmergeable."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise _Unmergeable
    if "$ref" in a or "$ref" in b or any(k in b for k in ("$defs", "definitions")):
        raise _Unmergeable  # draft <= 7 ignores $ref's siblings; definitions move their pointers
    if isinstance(a.get("exclusiveMinimum"), bool) or isinstance(b.get("exclusiveMinimum"), bool) or \
            isinstance(a.get("exclusiveMaximum"), bool) or isinstance(b.get("exclusiveMaximum"), bool):
        raise _Unmergeable  # draft-4 boolean exclusives modify minimum/maximum
    bk = {k for k in b if k not in ANNOTATIONS}
    for g in _GROUPS:
        if g & bk and g & set(a):
            raise _Unmergeable
    _check_object_keys(a, b)
    _check_object_keys(b, a)
    out = dict(a)
    for k in b:
        if k in ANNOTATIONS:
            continue
        v = b[k]
        if k not in out:
            out[k] = copy.deepcopy(v)
            continue
        out[k] = _merge_key(k, out[k], v)
    return out


def _check_object_keys(x: dict, y: dict) -> None:
    """additionalProperties of x constrains the keys x does not declare: merging y's properties
    in is exact only when y declares no key x does not and no patterns."""
    if "additionalProperties" not in x or x["additionalProperties"] is True or x["additionalProperties"] == {}:
        return
    if "additionalProperties" in y or "patternProperties" in y:
        raise _Unmergeable
    if not set(y.get("properties") or {}) <= set(x.get("properties") or {}):
        raise _Unmergeable


def _merge_key(k: str, x: Any, y: Any) -> Any:
    if x == y:
        return x
    if k == "type":
        tx = set(x) if isinstance(x, list) else {x}
        ty = set(y) if isinstance(y, list) else {y}
        both = (tx & ty) | ({"integer"} if ("integer" in tx and "number" in ty) or
                            ("number" in tx and "integer" in ty) else set())
        if not both or not all(isinstance(t, str) for t in both):
            raise _Unmergeable
        order = [t for t in (x if isinstance(x, list) else [x]) if t in both] + \
                [t for t in sorted(both) if t not in (x if isinstance(x, list) else [x])]
        return order[0] if len(order) == 1 else order
    if k == "required" and isinstance(x, list) and isinstance(y, list):
        return list(dict.fromkeys(x + y))
    if k in ("properties", "patternProperties") and isinstance(x, dict) and isinstance(y, dict):
        out = dict(x)
        for n, sub in y.items():
            out[n] = _conjoin(out[n], sub) if n in out else copy.deepcopy(sub)
        return out
    if k in ("items", "additionalProperties", "propertyNames") and isinstance(x, dict) and isinstance(y, dict):
        return _conjoin(x, y)
    if k in _MIN and _num(x) and _num(y):
        return max(x, y)
    if k in _MAX and _num(x) and _num(y):
        return min(x, y)
    if k == "uniqueItems" and isinstance(x, bool) and isinstance(y, bool):
        return x or y
    if k == "dependentRequired" and isinstance(x, dict) and isinstance(y, dict):
        out = dict(x)
        for n, req in y.items():
            out[n] = list(dict.fromkeys(out.get(n, []) + req))
        return out
    raise _Unmergeable


def _conjoin(x: Any, y: Any) -> Any:
    """allOf [x, y] as one schema where possible."""
    if x is True or x == {}:
        return copy.deepcopy(y)
    if y is True or y == {}:
        return x
    if x is False or y is False:
        return False
    try:
        return merge_schemas(x, y)
    except _Unmergeable:
        return {"allOf": [x, copy.deepcopy(y)]}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---- oneOf ---------------------------------------------------------------------------------

_BRANCH_KEYS = frozenset({"required", "properties", "type"})


def _distribute_oneof(s: dict) -> dict:
    branches = s["oneOf"]
    if s.get("type") != "object" or any(k in s for k in ("anyOf", "allOf", "not", "if")) or not branches:
        return s
    for b in branches:
        if not isinstance(b, dict) or not {k for k in b if k not in ANNOTATIONS} <= _BRANCH_KEYS:
            return s
        if b.get("type", "object") != "object" or _has_ref(b.get("properties", {})):
            return s
    base = {k: v for k, v in s.items() if k not in ("oneOf", "$defs", "definitions") and k not in ANNOTATIONS}
    try:
        merged = [merge_schemas(base, b) for b in branches]
    except _Unmergeable:
        return s
    if all(_disjoint(merged[i], merged[j]) for i, j in itertools.combinations(range(len(merged)), 2)):
        alts = merged
    else:
        alts = _forbid_variants(base, branches, merged)
        if alts is None:
            return s
    if not alts:
        return s  # no branch can be the only match: unsatisfiable, left to the backends' checks
    out = {k: v for k, v in s.items() if k in ANNOTATIONS or k in ("$defs", "definitions")}
    out["type"] = "object"
    out["anyOf"] = alts
    return out


def _values(sub: Any) -> list | None:
    if not isinstance(sub, dict):
        return None
    if "const" in sub:
        return [sub["const"]]
    return sub["enum"] if isinstance(sub.get("enum"), list) else None


def _canon(v: Any) -> str:
    """Equality as JSON Schema sees it (1 == 1.0, True != 1)."""
    def norm(x):
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, (int, float)):
            return ["#num", float(x)]
        if isinstance(x, list):
            return [norm(y) for y in x]
        return {k: norm(y) for k, y in x.items()}
    return json.dumps(norm(v), sort_keys=True)


def _disjoint(x: dict, y: dict) -> bool:
    """Proved: no instance satisfies both object schemas (a key both require with disjoint values)."""
    px, py = x.get("properties") or {}, y.get("properties") or {}
    for k in set(x.get("required") or []) & set(y.get("required") or []):
        vx, vy = _values(px.get(k)), _values(py.get(k))
        if vx is not None and vy is not None and not ({_canon(v) for v in vx} & {_canon(v) for v in vy}):
            return True
    return False


def _forbid_variants(base: dict, branches: list, merged: list) -> list | None:
    """oneOf of branches that only add `required`: branch i, with one key of every other branch's
    extra required keys forbidden (a false property schema), per choice of keys."""
    if any({k for k in b if k not in ANNOTATIONS} - {"required", "type"} for b in branches):
        return None
    if not all(isinstance(b.get("required", []), list) for b in branches):
        return None
    req = set(base.get("required") or [])
    sets = [set(b.get("required", [])) for b in branches]
    alts: list[dict] = []
    for i, m in enumerate(merged):
        have = req | sets[i]
        choices = [sorted(sets[j] - have) for j in range(len(sets)) if j != i]
        if any(not c for c in choices):
            continue  # whenever branch i matches, another one does too
        for pick in itertools.product(*choices):
            if len(alts) >= MAX_ONEOF_VARIANTS:
                return None
            v = copy.deepcopy(m)
            props = dict(v.get("properties") or {})
            for k in pick:
                props[k] = False
            v["properties"] = props
            if v not in alts:
                alts.append(v)
    return alts
