"""Validation at finish: is a finished JSON-schema output valid?

An exact grammar (CompiledGrammar.exact) that completed (finish_reason "stop" on a stop token)
produced a valid document by construction. Anything else with a JSON schema -- an approximated
grammar, an output cut by max_tokens or by a stop string -- is checked with jsonschema (formats
included). Other constraint kinds are not checked (None).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from deepinfer.grammar.backend import CompiledGrammar

_VALIDATORS: OrderedDict[str, Any] = OrderedDict()  # schema text -> jsonschema validator (LRU)
_MAX_VALIDATORS = 256
_LOCK = threading.Lock()


def _validator(schema_text: str):
    with _LOCK:
        v = _VALIDATORS.get(schema_text)
        if v is not None:
            _VALIDATORS.move_to_end(schema_text)
            return v
    import jsonschema

    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    v = cls(schema, format_checker=cls.FORMAT_CHECKER)
    with _LOCK:
        _VALIDATORS[schema_text] = v
        if len(_VALIDATORS) > _MAX_VALIDATORS:
            _VALIDATORS.popitem(last=False)
    return v


def first_violation(schema_text: str, text: str) -> str | None:
    """Why text is not a JSON document valid against the schema, or None when it is."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg} at character {e.pos})"
    err = next(iter(_validator(schema_text).iter_errors(value)), None)
    if err is None:
        return None
    where = "/" + "/".join(str(p) for p in err.absolute_path)
    return f"at {where}: {err.message}"[:500]


def check_output(compiled: CompiledGrammar | None, matcher: Any, text: str, finish_reason: str | None,
                 stop_reason: Any = None) -> tuple[bool | None, str | None]:
    """(valid, first violation) of a finished request's output; (None, None) when not checked
    (no JSON schema, or the request ended with an error or abort). matcher: the request's
    grammar matcher (its completion makes an exact grammar's output valid without a check)."""
    if compiled is None or compiled.spec.kind not in ("json_schema", "json_object"):
        return None, None
    if finish_reason not in ("stop", "length"):
        return None, None
    complete = matcher is not None and (matcher.is_terminated() or matcher.can_terminate())
    if compiled.exact and complete and finish_reason == "stop" and not isinstance(stop_reason, str):
        return True, None
    try:
        why = first_violation(compiled.spec.text, text)
    except Exception as e:  # e.g. jsonschema missing or a schema it cannot handle: say so, do not guess
        return None, f"not checked: {type(e).__name__}: {e}"
    return why is None, why
