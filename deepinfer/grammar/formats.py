"""String formats lowered to exact patterns before a backend sees the schema.

The backends' own `format: date` grammars accept any 2-digit day (2024-02-30 passes; JSONSchemaBench's
invalid instances include exactly such dates: 8 of the 24 invalid documents our grammars accepted).
A date has a regular language, leap years included, so it is rewritten as a `pattern` every backend
enforces exactly. The pattern accepts exactly what jsonschema's FormatChecker accepts for "date":
YYYY-MM-DD in ASCII digits that `datetime.date.fromisoformat` takes (years 0001-9999, the days of
each month, 29 February only in Gregorian leap years).
"""

from __future__ import annotations

import copy
from typing import Any

from deepinfer.grammar.exactness import subschemas

_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
# divisible by 4 and not by 100 (the last two digits), or by 400 (0000 is not a year)
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
DATE_PATTERN = (
    "^(" + _YEAR + "-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    "|02-(0[1-9]|1[0-9]|2[0-8]))|" + _LEAP + "-02-29)$"
)

_PATTERNS = {"date": DATE_PATTERN}


def lower_formats(schema: Any) -> Any:
    """schema with every lowerable `format` replaced by its exact pattern (a copy; the input
    itself when nothing changes). A string schema that already has a pattern or length bounds
    keeps its format: two patterns cannot be combined into one exactly here."""
    if not isinstance(schema, dict) or not any(_lowerable(s) for s in subschemas(schema)):
        return schema
    out = copy.deepcopy(schema)
    for s in subschemas(out):
        if _lowerable(s):
            s["pattern"] = _PATTERNS[s.pop("format")]
    return out


def _lowerable(s: dict) -> bool:
    return (isinstance(s.get("format"), str) and s["format"] in _PATTERNS
            and not any(k in s for k in ("pattern", "minLength", "maxLength")))
