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


def schema_from_type(tp: Any) -> dict:
    """A JSON schema (dict) for a Python type: msgspec.Struct, TypedDict, dataclass, type hint
    such as list[int] / dict[str, float] / Literal[...] / Optional[...], or a pydantic model."""
    if _is_pydantic_model(tp):
        return tp.model_json_schema()
    try:
        return msgspec.json.schema(tp)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"invalid JSON schema: cannot derive a schema from type {tp!r} ({e})") from e


def _schema_text(json_schema: Any) -> tuple[str, Any]:
    """Canonical schema text plus the Python type to decode into (None for dict/str schemas)."""
    if isinstance(json_schema, str):
        try:
            obj = json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid JSON schema: the string is not valid JSON ({e})") from e
        if not isinstance(obj, (dict, bool)):
            raise GrammarError(f"invalid JSON schema: expected an object, got {type(obj).__name__}")
        return _canonical_json(obj), None
    if isinstance(json_schema, dict):
        return _canonical_json(json_schema), None
    if isinstance(json_schema, bool):
        return _canonical_json(json_schema), None
    if json_schema is None:
        raise GrammarError("invalid JSON schema: None")
    return _canonical_json(schema_from_type(json_schema)), json_schema


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
) -> GrammarSpec | None:
    """Build the GrammarSpec of at most one constraint; None when unconstrained.

    Raises GrammarError when more than one constraint is given or one is malformed (a schema
    string that is not JSON, an unsupported type or dtype, empty choices). Regex/EBNF syntax is
    checked when the spec is compiled.
    """
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
        text, py_type = _schema_text(json_schema)
        return GrammarSpec("json_schema", text, py_type=py_type)
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
    )
