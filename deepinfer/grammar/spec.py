"""GrammarSpec: the canonical, hashable description of one output constraint.

`spec_from_params` turns the user-facing constraint arguments (regex / json_schema / grammar /
choices / dtype / json_object) into a GrammarSpec whose (kind, text) is the cache key of the
compiler: two requests with equal specs share one compiled grammar. A schema's text is canonical
(`canonical_schema`: keywords sorted, whitespace dropped, properties in declared order), so a job
that repeats a schema spelled in another keyword order compiles it once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from deepinfer.errors import GrammarError

KINDS = ("regex", "json_schema", "ebnf", "choices", "json_object")

# dtype shortcuts. Integers are bounded to 19 digits (fits int64) so a model cannot loop on
# digits forever; floats allow a bounded mantissa, fraction and exponent.
DTYPE_REGEX: dict[str, str] = {
    "int": r"-?(0|[1-9][0-9]{0,18})",
    "float": r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,3})?",
    "bool": r"(true|false)",
    # a JSON string literal (decoded with json.loads), so quotes/escapes round-trip exactly
    "str": r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*"',
}
_DTYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}

# json_object mode: any JSON object, compiled through the schema path (never xgrammar's builtin
# JSON grammar, whose token mask rejects `}]` after `[{"b": "x"` although its matcher accepts it).
JSON_OBJECT_SCHEMA = '{"type":"object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: `kind` (one of KINDS) and its canonical `text`.

    text is a regex for "regex", canonical JSON-schema text for "json_schema"/"json_object", an
    EBNF grammar (GBNF style, `root ::= ...`) for "ebnf", and a JSON list of the exact strings for
    "choices". `py_type` (not part of equality/hash) remembers the user's Python type so
    `decode_output` can rebuild it; `dtype` names a dtype shortcut ("int", "float", ...).
    """

    kind: str
    text: str
    py_type: Any = field(default=None, compare=False, hash=False, repr=False)
    dtype: str | None = field(default=None, compare=False, hash=False)
    #: what spec_from_params narrowed in the user's constraint (e.g. the integer digit cap); part
    #: of the key: a schema capped here and the same bounds written by the user are reported apart
    narrowed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {KINDS}")
        if not isinstance(self.text, str) or not self.text:
            raise GrammarError(f"grammar text for kind {self.kind!r} must be a non-empty string")

    @property
    def choices(self) -> list[str]:
        """The exact strings of a "choices" spec."""
        if self.kind != "choices":
            raise GrammarError(f"spec of kind {self.kind!r} has no choices")
        return json.loads(self.text)


def _is_pydantic_model(obj: Any) -> bool:
    try:
        import pydantic  # optional: never a dependency
    except ImportError:
        return False
    return isinstance(obj, type) and issubclass(obj, pydantic.BaseModel)


# Schema keywords whose value is data (their key order is the value's own: a const object is
# generated in its own key order), maps of names to subschemas, and lists of / single subschemas.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_NAME_MAPS = frozenset({"$defs", "definitions", "patternProperties", "dependentSchemas", "dependencies"})
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SUBSCHEMAS = frozenset({"additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not",
                         "if", "then", "else", "unevaluatedProperties", "unevaluatedItems", "contentSchema"})


def canonical_schema(schema: Any) -> Any:
    """schema with every schema object's keywords in sorted order, so two spellings of one schema
    that differ only in keyword order (or whitespace, once serialised) are one cache entry.
    Kept as given: the order of `properties` (backends generate properties in declared order, so
    another order is another grammar), lists (anyOf branches, prefixItems, required, enum) and data
    values (const / enum / default / examples: a const object is generated in its own order)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k in sorted(schema, key=str):
        v = schema[k]
        if k in _DATA_KEYWORDS:
            out[k] = v
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: canonical_schema(sub) for name, sub in v.items()}
        elif k in _NAME_MAPS and isinstance(v, dict):  # names are looked up, never generated in order
            out[k] = {name: canonical_schema(v[name]) for name in sorted(v, key=str)}
        elif k in _SUBSCHEMA_LISTS and isinstance(v, list):
            out[k] = [canonical_schema(sub) for sub in v]
        elif k in _SUBSCHEMAS:
            out[k] = canonical_schema(v)
        else:  # type, required, bounds, patterns, unknown keywords: as given
            out[k] = v
    return out


def _canonical_json(obj: Any) -> str:
    # keywords sorted, properties in declared order (canonical_schema); compact separators
    try:
        return json.dumps(canonical_schema(obj), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"invalid JSON schema: not JSON-serialisable ({e})") from e


def _is_pydantic_meta(m: Any) -> bool:
    """pydantic's constraint metadata in an Annotated (Field(...), conint's annotated_types bounds)."""
    return type(m).__module__.split(".")[0] in ("pydantic", "pydantic_core", "annotated_types")


def _constraint_sources(tp: Any) -> set[str]:
    """Who can read tp's constraints: "pydantic" (a model, or Field / conint / annotated_types
    metadata anywhere in it), "msgspec" (msgspec.Meta anywhere), "struct" (a msgspec.Struct in it,
    which pydantic cannot read). A type needing both readers cannot keep all its bounds."""
    import dataclasses
    import typing

    found: set[str] = set()
    seen: set[int] = set()

    def walk(t: Any) -> None:
        if id(t) in seen:
            return
        seen.add(id(t))
        if _is_pydantic_model(t):
            found.add("pydantic")
            return
        if typing.get_origin(t) is typing.Annotated:
            base, *meta = typing.get_args(t)
            for m in meta:
                if isinstance(m, msgspec.Meta):
                    found.add("msgspec")
                elif _is_pydantic_meta(m):
                    found.add("pydantic")
            walk(base)
            return
        for a in typing.get_args(t):
            walk(a)
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            found.add("struct")
        if isinstance(t, type) and (issubclass(t, msgspec.Struct) or dataclasses.is_dataclass(t)
                                    or typing.is_typeddict(t)):
            try:
                hints = typing.get_type_hints(t, include_extras=True)
            except Exception:  # an unresolvable annotation: msgspec reports it with its own words
                return
            for h in hints.values():
                walk(h)

    walk(tp)
    return found


def uses_pydantic(tp: Any) -> bool:
    """Whether tp's schema and decoding go through pydantic (a model, or pydantic constraints in
    a type hint / dataclass / TypedDict, which msgspec would silently drop)."""
    return _is_pydantic_model(tp) or "pydantic" in _constraint_sources(tp)


def schema_from_type(tp: Any) -> dict:
    """A JSON schema (dict) for a Python type: msgspec.Struct, TypedDict, dataclass, type hint
    such as list[int] / dict[str, float] / Literal[...] / Optional[...], or a pydantic model.

    Bounds travel into the schema: msgspec.Meta (ge/le/gt/lt, min_length/max_length, pattern,
    multiple_of) through msgspec; pydantic's Field(...) / conint / constr / Annotated bounds, also
    on a plain hint, dataclass or TypedDict, through pydantic.TypeAdapter (msgspec ignores them:
    `conint(gt=0)` gave {"type": "integer"}). A type mixing msgspec Structs or Meta with pydantic
    constraints is refused: neither library reads the other's, so some bound would be dropped."""
    if _is_pydantic_model(tp):
        return tp.model_json_schema()
    sources = _constraint_sources(tp)
    if "pydantic" in sources:
        if sources & {"struct", "msgspec"}:
            raise GrammarError(
                f"invalid JSON schema: type {tp!r} mixes pydantic constraints (Field / conint / constr / a model) "
                "with msgspec ones (Struct / Meta); neither library reads the other's, so a bound would be "
                "dropped: use one of them")
        import pydantic

        try:
            return pydantic.TypeAdapter(tp).json_schema()
        except Exception as e:  # pydantic's own errors (PydanticUserError, schema generation errors)
            raise GrammarError(f"invalid JSON schema: pydantic cannot derive a schema from type {tp!r} ({e})") from e
    try:
        return msgspec.json.schema(tp)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"invalid JSON schema: cannot derive a schema from type {tp!r} ({e})") from e


def _schema_obj(json_schema: Any) -> tuple[Any, Any]:
    """The schema (dict or bool) plus the Python type to decode into (None for dict/str schemas)."""
    if isinstance(json_schema, str):
        try:
            obj = json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid JSON schema: the string is not valid JSON ({e})") from e
        if not isinstance(obj, (dict, bool)):
            raise GrammarError(f"invalid JSON schema: expected an object, got {type(obj).__name__}")
        return obj, None
    if isinstance(json_schema, (dict, bool)):
        return json_schema, None
    if json_schema is None:
        raise GrammarError("invalid JSON schema: None")
    return schema_from_type(json_schema), json_schema


def _schema_text(json_schema: Any) -> tuple[str, Any]:
    """Canonical schema text plus the Python type to decode into (None for dict/str schemas)."""
    obj, py_type = _schema_obj(json_schema)
    return _canonical_json(obj), py_type


# ---- the integer digit cap (SamplingParams.max_integer_digits) ---------------------------------
# An integer with no bound lets a sampled model write digits until max_tokens: on SmolLM2-135M,
# 200 gens of {name: str, age: int} at max_tokens=48 gave `"age": 30231062910325294954...` (35
# digits). The cap is a bound on each side left open, |n| < 10**digits. 15 is the most llguidance
# keeps exact: it reads bounds as doubles, so maximum 10**18 - 1 let 10**18 through (exact up to
# 2**53 ~ 9.0e15), and it fails to compile bounds of 19 digits (int64's included).
MAX_INTEGER_DIGITS = 15
#: the name a capped integer gets in the narrowed list (RequestOutput.grammar_approximated)
INTEGER_CAP = "integer digits (max_integer_digits)"
# where capping a subschema only narrows the whole (never under not / oneOf / if, where a
# narrower subschema can let more instances through), and the maps and lists holding subschemas
_CAP_SUBSCHEMAS = ("additionalProperties", "additionalItems", "items", "contains", "then", "else",
                   "unevaluatedProperties", "unevaluatedItems")
_CAP_LISTS = ("allOf", "anyOf", "prefixItems", "items")
_CAP_MAPS = ("properties", "patternProperties", "dependentSchemas")
_WIDENING = ("not", "oneOf", "if")


def _mentions(schema: Any, keys: tuple[str, ...]) -> bool:
    if isinstance(schema, dict):
        return any(k in schema for k in keys) or any(_mentions(v, keys) for v in schema.values())
    if isinstance(schema, list):
        return any(_mentions(v, keys) for v in schema)
    return False


def _cap_node(s: dict, limit: int) -> bool:
    """Bound the open sides of an integer schema s in place; whether anything was added."""
    t = s.get("type")
    integer = t == "integer" or (isinstance(t, list) and "integer" in t and "number" not in t)
    if not integer or "enum" in s or "const" in s:
        return False
    nums = [v for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
            if isinstance(v := s.get(k), (int, float)) and not isinstance(v, bool)]
    if any(abs(v) >= limit for v in nums):  # a bound past the cap: the user asked for big numbers
        return False
    added = False
    if "minimum" not in s and "exclusiveMinimum" not in s:
        s["minimum"] = -(limit - 1)
        added = True
    if "maximum" not in s and "exclusiveMaximum" not in s:
        s["maximum"] = limit - 1
        added = True
    return added


def cap_integers(schema: Any, digits: int) -> tuple[Any, bool]:
    """(schema with every unbounded integer given at most `digits` digits, whether any was);
    schema itself is left as it was. Only where that narrows the language: never under not,
    oneOf or if, and the definitions only when the schema has none of those anywhere (a ref
    from under one of them would see the capped definition)."""
    if not isinstance(schema, dict):
        return schema, False
    limit = 10 ** digits
    out = json.loads(json.dumps(schema))  # a deep copy (a schema is JSON)
    hit = False

    def walk(s: Any) -> None:
        nonlocal hit
        if not isinstance(s, dict):
            return
        hit = _cap_node(s, limit) or hit
        for k in _CAP_SUBSCHEMAS:
            if isinstance(s.get(k), dict):
                walk(s[k])
        for k in _CAP_LISTS:
            if isinstance(s.get(k), list):
                for x in s[k]:
                    walk(x)
        for k in _CAP_MAPS:
            if isinstance(s.get(k), dict):
                for x in s[k].values():
                    walk(x)

    walk(out)
    if not _mentions(schema, _WIDENING):
        for k in ("$defs", "definitions"):
            if isinstance(out.get(k), dict):
                for x in out[k].values():
                    walk(x)
    return (out, True) if hit else (schema, False)


def dtype_name(dtype: Any) -> str:
    """Normalise a dtype (int/float/bool/str or their names) to its name."""
    if isinstance(dtype, str) and dtype in DTYPE_REGEX:
        return dtype
    if isinstance(dtype, type) and dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    raise GrammarError(f"unsupported dtype {dtype!r}; expected one of int, float, bool, str")


def spec_from_params(
    regex: str | None = None,
    json_schema: Any = None,
    grammar: str | None = None,
    choices: list[str] | None = None,
    dtype: Any = None,
    json_object: bool = False,
    max_integer_digits: int | None = None,
) -> GrammarSpec | None:
    """Build the GrammarSpec of at most one constraint; None when unconstrained.

    max_integer_digits (json_schema only): every integer of the schema with an open side gets
    a bound there, |n| < 10**max_integer_digits (1 to MAX_INTEGER_DIGITS), listed in the spec's
    `narrowed` as INTEGER_CAP; None leaves them unbounded (the default here; SamplingParams
    defaults to MAX_INTEGER_DIGITS).

    Raises GrammarError when more than one constraint is given or one is malformed (a schema
    string that is not JSON, an unsupported type or dtype, empty choices). Regex/EBNF syntax is
    checked when the spec is compiled.
    """
    if max_integer_digits is not None and not (
        isinstance(max_integer_digits, int) and not isinstance(max_integer_digits, bool)
        and 1 <= max_integer_digits <= MAX_INTEGER_DIGITS
    ):
        raise GrammarError(f"max_integer_digits must be an int in [1, {MAX_INTEGER_DIGITS}] or None, "
                           f"got {max_integer_digits!r}")
    given = [
        name
        for name, v in (
            ("regex", regex), ("json_schema", json_schema), ("grammar", grammar),
            ("choices", choices), ("dtype", dtype), ("json_object", json_object or None),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise GrammarError(f"give at most one constraint, got {', '.join(given)}")
    if not given:
        return None
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise GrammarError(f"invalid regex: expected a non-empty string, got {regex!r}")
        return GrammarSpec("regex", regex)
    if json_schema is not None:
        obj, py_type = _schema_obj(json_schema)
        capped = False
        if max_integer_digits is not None:
            obj, capped = cap_integers(obj, max_integer_digits)
        return GrammarSpec("json_schema", _canonical_json(obj), py_type=py_type,
                           narrowed=(INTEGER_CAP,) if capped else ())
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError(f"invalid EBNF: expected a non-empty grammar string, got {grammar!r}")
        return GrammarSpec("ebnf", grammar)
    if choices is not None:
        if (
            isinstance(choices, (str, bytes))
            or not isinstance(choices, (list, tuple))
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise GrammarError(f"invalid choices: expected a non-empty list of non-empty strings, got {choices!r}")
        # dedupe but keep order: the grammar is over exactly these strings
        return GrammarSpec("choices", json.dumps(list(dict.fromkeys(choices)), ensure_ascii=False))
    if dtype is not None:
        name = dtype_name(dtype)
        return GrammarSpec("regex", DTYPE_REGEX[name], dtype=name)
    return GrammarSpec("json_object", JSON_OBJECT_SCHEMA)


def spec_of(obj: Any) -> GrammarSpec | None:
    """A GrammarSpec as is, or the spec of anything with the constraint attributes
    (e.g. deepinfer.engine.SamplingParams)."""
    if obj is None or isinstance(obj, GrammarSpec):
        return obj
    return spec_from_params(
        regex=getattr(obj, "regex", None),
        json_schema=getattr(obj, "json_schema", None),
        grammar=getattr(obj, "grammar", None),
        choices=getattr(obj, "choices", None),
        dtype=getattr(obj, "dtype", None),
        json_object=bool(getattr(obj, "json_object", False)),
        max_integer_digits=getattr(obj, "max_integer_digits", None),
    )
