"""The results file: crash-safe appends, resume, and optional input-order writing.

Each finished record is one JSON line, appended and flushed at once (fsync'd every
`fsync_interval` seconds and at close), so after a crash or `kill -9` the file holds every record
written before it plus at most one half-written last line. `recover` truncates such a line and
returns the ids already written, which `--resume` skips: a re-run never duplicates a record.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from deepinfer.jobs.errors import JobUsageError
from deepinfer.jobs.records import record_key


def to_jsonable(value: Any) -> Any:
    """Program variables as JSON data: msgspec.Struct/dataclass -> dict, pydantic -> dict, else str."""
    import msgspec

    def enc_hook(obj: Any) -> Any:
        dump = getattr(obj, "model_dump", None)  # pydantic models
        if callable(dump):
            return dump(mode="json")
        return str(obj)

    return msgspec.to_builtins(value, enc_hook=enc_hook, str_keys=True)


def result_key(obj: dict[str, Any]) -> str:
    """The record_key of a `deepinfer run` result line."""
    return record_key(obj["id"], obj.get("line"), bool(obj.get("implicit_id")))


def recover(path: str, key_of: Callable[[dict[str, Any]], str] = result_key) -> tuple[set[str], int]:
    """Keys (`key_of` each line; by default record_key) of the records in an existing results
    file, after truncating a half line.

    Returns (ids, bytes_truncated). A last line without its newline is cut off (it was being
    written when the job died); complete lines that do not parse are an error.
    """
    if not os.path.exists(path):
        return set(), 0
    ids: set[str] = set()
    good_end = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break  # the half-written tail
            if raw.strip():
                try:
                    obj = json.loads(raw)
                    ids.add(key_of(obj))
                except (ValueError, KeyError, TypeError) as e:
                    raise JobUsageError(f"{path!r} line {n} is not a result record ({e}); cannot resume from it")
            good_end += len(raw)
        size = f.seek(0, os.SEEK_END)
    cut = size - good_end
    if cut:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
    return ids, cut


class ResultWriter:
    """Appends result lines; with `ordered`, holds finished records until all earlier ones are out.

    Records are identified by their input sequence number `seq`; `skip(seq)` marks one that needs
    no line (already written by an earlier run).
    """

    def __init__(self, path: str, ordered: bool = False, fsync_interval: float = 1.0) -> None:
        self.path, self.ordered, self.fsync_interval = path, ordered, fsync_interval
        self._f = open(path, "ab")
        self._next = 0
        self._held: dict[int, bytes | None] = {}
        self._last_sync = time.monotonic()
        self.written = 0

    def write(self, seq: int, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        self._put(seq, line)

    def skip(self, seq: int) -> None:
        self._put(seq, None)

    def _put(self, seq: int, line: bytes | None) -> None:
        if not self.ordered:
            if line is not None:
                self._emit(line)
            return
        self._held[seq] = line
        while self._next in self._held:
            held = self._held.pop(self._next)
            self._next += 1
            if held is not None:
                self._emit(held)

    def _emit(self, line: bytes) -> None:
        # one write call per line, flushed at once: a crash leaves at most the last line partial
        self._f.write(line)
        self._f.flush()
        self.written += 1
        now = time.monotonic()
        if now - self._last_sync >= self.fsync_interval:
            os.fsync(self._f.fileno())
            self._last_sync = now

    @property
    def held(self) -> int:
        """Finished records waiting for an earlier one (ordered mode)."""
        return sum(1 for v in self._held.values() if v is not None)

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
