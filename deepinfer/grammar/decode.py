"""decode_output: turn constrained output text back into the value the user asked for."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from deepinfer.errors import GrammarError
from deepinfer.grammar.spec import _is_pydantic_model, spec_of, uses_pydantic


def _decode_dtype(name: str, text: str) -> Any:
    try:
        if name == "int":
            return int(text)
        if name == "float":
            return float(text)
        if name == "bool":
            low = text.strip().lower()
            if low not in ("true", "false"):
                raise ValueError(f"not a boolean: {text!r}")
            return low == "true"
        return json.loads(text)  # "str": a JSON string literal
    except (ValueError, json.JSONDecodeError) as e:
        raise GrammarError(f"output {text!r} does not decode as {name}: {e}") from e


def decode_output(spec_or_params: Any, text: str) -> Any:
    """Parse constrained output `text` into the user's type.

    spec_or_params is a GrammarSpec or an object with constraint attributes (SamplingParams).
    JSON schemas given as a msgspec.Struct / TypedDict / type hint decode through msgspec into
    that type (its msgspec.Meta bounds checked), a pydantic model through model_validate_json, a
    type with pydantic constraints (Field / conint / constr) through pydantic.TypeAdapter, a dict/str schema and json_object
    into plain Python objects; dtype specs give int/float/bool/str; regex, choices and EBNF give
    the text itself. Raises GrammarError when the text does not parse as required.
    """
    spec = spec_of(spec_or_params)
    if spec is None:
        return text
    if spec.dtype is not None:
        return _decode_dtype(spec.dtype, text)
    if spec.kind in ("json_schema", "json_object"):
        tp = spec.py_type
        try:
            if tp is None:
                return json.loads(text)
            if _is_pydantic_model(tp):
                return tp.model_validate_json(text)
            if uses_pydantic(tp):  # pydantic bounds in a hint / dataclass / TypedDict (spec.schema_from_type)
                import pydantic

                return pydantic.TypeAdapter(tp).validate_json(text)
            return msgspec.json.decode(text.encode("utf-8"), type=tp)
        except Exception as e:  # json / msgspec / pydantic each raise their own error type
            raise GrammarError(f"output does not decode as the requested JSON type: {e}") from e
    if spec.kind == "choices" and text not in spec.choices:
        raise GrammarError(f"output {text!r} is not one of the choices {spec.choices!r}")
    return text
