"""Stream input records (JSON lines) into program arguments, one line at a time.

A record's id is its `id` field when it has one, else its 1-based line number (an *implicit*
id). Implicit ids live in a namespace of their own (`record_key`), so a line without an id can
never be mistaken on --resume for a record whose explicit id equals its line number; explicit ids
must be unique (`check_unique_ids` refuses an input that repeats one). A line that is not a JSON
object, or lacks a program argument, becomes a Record with `error` set (the job writes an error
record for it and goes on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

from deepinfer.jobs.errors import JobUsageError
from deepinfer.jobs.program import ProgramSignature


@dataclass
class Record:
    """One input line: its position, id and the program's arguments (or why there are none)."""

    seq: int  # 0-based index among the records of this input (blank lines are not records)
    line: int  # 1-based line number in the file
    id: Any
    kwargs: dict[str, Any] | None
    error: str | None = None
    implicit_id: bool = False  # id is the line number (the line has no `id` field)

    @property
    def key(self) -> str:
        return record_key(self.id, self.line, self.implicit_id)


def id_key(record_id: Any) -> str:
    """A hashable, type-exact key for an id (1 and "1" are different ids)."""
    return json.dumps(record_id, sort_keys=True, ensure_ascii=False)


def record_key(record_id: Any, line: int, implicit: bool) -> str:
    """What --resume matches records by: an explicit id's id_key, or for an implicit id "line:N",
    which no id_key (a JSON text) can equal."""
    return f"line:{line}" if implicit else id_key(record_id)


def _id_of(obj: Any, line_no: int, id_field: str = "id") -> tuple[Any, bool]:
    """(id, implicit) of a parsed line."""
    if isinstance(obj, dict) and id_field in obj:
        return obj[id_field], False
    return line_no, True


def parse_map(items: list[str] | None) -> dict[str, str]:
    """`--map old=new` options as {input field: program argument}."""
    out: dict[str, str] = {}
    for item in items or []:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise JobUsageError(f"--map needs OLD=NEW (input field = program argument), got {item!r}")
        if old in out:
            raise JobUsageError(f"--map renames field {old!r} twice")
        out[old] = new
    return out


def check_mapping(sig: ProgramSignature, mapping: dict[str, str], field: str | None) -> None:
    """Fail before the model loads when --map/--field name arguments the program does not take."""
    targets = list(mapping.values()) + ([field] if field else [])
    if not sig.var_keyword:
        for t in targets:
            if t not in sig.names:
                raise JobUsageError(f"the program has no argument {t!r} (it takes: {', '.join(sig.names) or 'none'})")
    if field and mapping:
        raise JobUsageError("--field passes each whole line as one argument; it cannot be combined with --map")


def to_record(seq: int, line_no: int, raw: str, sig: ProgramSignature, mapping: dict[str, str],
              field: str | None) -> Record:
    """Parse one non-blank line into a Record (never raises for bad data)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return Record(seq, line_no, line_no, None, f"line {line_no} is not valid JSON: {e}", implicit_id=True)
    rid, implicit = _id_of(obj, line_no)
    if field is not None:
        return Record(seq, line_no, rid, {field: obj}, implicit_id=implicit)
    if not isinstance(obj, dict):
        return Record(seq, line_no, rid, None,
                      f"line {line_no} is a JSON {type(obj).__name__}, not an object of program arguments",
                      implicit_id=implicit)
    fields = {mapping.get(k, k): v for k, v in obj.items()}
    missing = [n for n in sig.required if n not in fields]
    if missing:
        return Record(seq, line_no, rid, None,
                      f"record lacks program argument(s) {', '.join(map(repr, missing))} "
                      f"(its fields: {', '.join(sorted(obj)) or 'none'})", implicit_id=implicit)
    kwargs = fields if sig.var_keyword else {k: v for k, v in fields.items() if k in sig.names}
    return Record(seq, line_no, rid, kwargs, implicit_id=implicit)


def nonblank_lines(path: str, limit: int | None) -> Iterator[tuple[int, str]]:
    """(line number, text) of the first `limit` non-blank lines, streamed."""
    n = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, raw in enumerate(f, start=1):
            if limit is not None and n >= limit:
                return
            if raw.strip():
                n += 1
                yield line_no, raw


def iter_records(path: str, sig: ProgramSignature, mapping: dict[str, str] | None = None,
                 field: str | None = None, limit: int | None = None) -> Iterator[Record]:
    """Records of a JSON-lines file, read lazily (the file is never held in memory)."""
    mapping = mapping or {}
    for seq, (line_no, raw) in enumerate(nonblank_lines(path, limit)):
        yield to_record(seq, line_no, raw, sig, mapping, field)


def count_records(path: str, limit: int | None = None) -> int:
    """Number of non-blank lines (for the progress bar's total), streamed."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                n += 1
                if limit is not None and n >= limit:
                    break
    return n


def check_unique_ids(path: str, limit: int | None = None, id_field: str = "id") -> None:
    """Refuse (JobUsageError) an input in which two records share an explicit id: results are
    matched to records by id, so --resume would skip the second as done. Streams the file once,
    holding only the keys of the ids seen."""
    seen: dict[str, int] = {}
    for line_no, raw in nonblank_lines(path, limit):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue  # an error record with an implicit id: it cannot collide
        rid, implicit = _id_of(obj, line_no, id_field)
        if implicit:
            continue
        key = id_key(rid)
        first = seen.setdefault(key, line_no)
        if first != line_no:
            raise JobUsageError(
                f"{path}: id {rid!r} appears on lines {first} and {line_no}; record ids must be unique "
                "(results and --resume match records by id)"
            )
