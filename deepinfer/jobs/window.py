"""The in-flight window shared by every job kind: at most `size` records submitted at once, a
finished one's slot refilled at once, the input never read ahead of the window.

A job kind is a `Task`: `submit(rec)` starts one record (a `concurrent.futures.Future`) and
`result(rec, value, error)` turns what came back into the output line. The window knows nothing
of programs, OpenAI bodies or files; `stream.run_stream` (local) and `ray_pool` (actors) drive it.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from deepinfer.jobs.records import Record


@dataclass
class Finished:
    """One record's output line and what the progress line counts."""

    seq: int
    key: str
    line: dict[str, Any]
    ok: bool
    tokens: int


class Task(Protocol):
    def submit(self, rec: Record) -> Future: ...

    def result(self, rec: Record, value: Any = None, error: BaseException | str | None = None) -> Finished: ...


def run_window(task: Task, records: Iterable[Record], size: int, on_finished: Callable[[Finished], None]) -> None:
    """Run every record through `task` with at most `size` in flight; `on_finished` gets each
    result as it completes. A bad record or a failing submit becomes that record's error line."""
    in_flight: dict[Future, Record] = {}

    def reap(block: bool) -> None:
        finished, _ = wait(list(in_flight), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for fut in finished:
            rec = in_flight.pop(fut)
            try:
                value = fut.result()
            except Exception as e:  # the runtime itself failed this record
                on_finished(task.result(rec, error=e))
                continue
            on_finished(task.result(rec, value))

    for rec in records:
        if rec.error is not None:
            on_finished(task.result(rec, error=rec.error))
            continue
        try:
            fut = task.submit(rec)
        except Exception as e:
            on_finished(task.result(rec, error=e))
            continue
        in_flight[fut] = rec
        while len(in_flight) >= size:
            reap(block=True)
    while in_flight:
        reap(block=True)
