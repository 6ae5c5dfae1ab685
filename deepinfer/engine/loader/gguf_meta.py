"""Opening GGUF files and reading their metadata fields as plain Python values."""

from __future__ import annotations

import os
from typing import Any

from deepinfer.errors import ModelLoadError

_MISSING = object()


def open_gguf(path: str | os.PathLike) -> Any:
    """A `gguf.GGUFReader` on `path`, or ModelLoadError naming the file when it is not readable GGUF."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/struct errors/IndexError on bad bytes
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata field `key` (scalar, str, or list); `default` when absent, else an error."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata lacks required field {key!r}")
        return default
    try:
        return f.contents()
    except Exception as e:
        raise ModelLoadError(f"GGUF metadata field {key!r} is unreadable: {e}") from e
