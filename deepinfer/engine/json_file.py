"""Reading the JSON files of a model directory (config, tokenizer config, safetensors index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer.errors import ModelLoadError


def read_json_object(path: Path, what: str | None = None) -> dict[str, Any]:
    """Parse a JSON object file; any problem is a ModelLoadError naming `what` (or the file) and the path."""
    what = what or path.name
    if not path.is_file():
        raise ModelLoadError(f"no {what} at {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {what} {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} {path} must hold a JSON object")
    return data
