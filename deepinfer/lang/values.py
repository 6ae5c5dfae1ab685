"""Turn a generation's text into the value `s[name]` returns.

One function, `decode_value`, so the structured-output decoder can be swapped in one place: it
uses deepinfer.grammar's `decode_output` when that package provides it, else a local JSON/dtype
parser with the same contract.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.errors import GrammarError, ProgramError

try:  # the grammar package owns decoding of constrained output
    from deepinfer.grammar import decode_output as _grammar_decode  # type: ignore[attr-defined]
except ImportError:
    try:
        from deepinfer.grammar.decode import decode_output as _grammar_decode
    except ImportError:  # grammar package not available: use the local parser below
        _grammar_decode = None


def _local_decode(params: Any, text: str) -> Any:
    dtype = getattr(params, "dtype", None)
    schema = getattr(params, "json_schema", None)
    if dtype is not None:
        name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", str(dtype))
        if name == "int":
            return int(text.strip())
        if name == "float":
            return float(text.strip())
        if name == "bool":
            low = text.strip().lower()
            if low not in ("true", "false"):
                raise ValueError(f"not a boolean: {text!r}")
            return low == "true"
        return json.loads(text)  # dtype str is constrained to a JSON string literal
    if schema is not None or getattr(params, "json_object", False):
        obj = json.loads(text)
        if isinstance(schema, type):
            if hasattr(schema, "model_validate"):  # pydantic model
                return schema.model_validate(obj)
            import msgspec

            return msgspec.convert(obj, type=schema)
        return obj
    return text


def decode_value(name: str | None, params: Any, text: str) -> Any:
    """The value of a finished gen: decoded structure / dtype, or the text itself.

    Raises ProgramError naming the variable when the text does not decode (e.g. the output was
    cut by max_tokens in the middle of a JSON object).
    """
    if not getattr(params, "constrained", False):
        return text
    try:
        if _grammar_decode is not None:
            return _grammar_decode(params, text)
        return _local_decode(params, text)
    except (GrammarError, ValueError, TypeError) as e:
        raise ProgramError(f"gen {name!r}: output {text[:200]!r} does not decode: {e}") from e
    except Exception as e:  # msgspec.ValidationError / pydantic.ValidationError
        raise ProgramError(f"gen {name!r}: output {text[:200]!r} does not decode: {e}") from e
