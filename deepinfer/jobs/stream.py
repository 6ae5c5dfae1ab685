"""One job's plumbing around its executor: resume (recover the output, skip what it holds),
the results writer, progress, and the summary. Every job kind (`deepinfer run`, `run-batch`,
local or on Ray) goes through `run_stream`; only the executor and the task differ.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from deepinfer.jobs.output import ResultWriter, recover, result_key
from deepinfer.jobs.progress import Progress
from deepinfer.jobs.records import Record
from deepinfer.jobs.window import Finished

#: executor(records, on_finished): runs every record, calling on_finished once per record
Executor = Callable[[Iterator[Record], Callable[[Finished], None]], None]


@dataclass
class JobSummary:
    """Counts of one job run (records skipped by --resume are not processed again)."""

    processed: int = 0
    failed: int = 0
    skipped: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    truncated_bytes: int = 0

    @property
    def ok(self) -> int:
        return self.processed - self.failed

    def line(self) -> str:
        rate = self.processed / self.elapsed_s if self.elapsed_s > 0 else 0.0
        tps = self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (f"[deepinfer run] done: {self.processed} records ({self.ok} ok, {self.failed} failed), "
                f"{self.skipped} skipped (already in output), {self.elapsed_s:.1f}s, "
                f"{rate:.2f} rec/s, {tps:.1f} tok/s")


def run_stream(opts: Any, records: Iterable[Record], total: int, execute: Executor,
               record_key: Callable[[Record], str] = lambda r: r.key,
               line_key: Callable[[dict[str, Any]], str] = result_key) -> JobSummary:
    """Write one output line per record of `records` not already in `opts.output` (with
    `opts.resume`), running them through `execute`. Each key is written at most once: a record
    an executor reports twice (a retried Ray block) is written the first time only."""
    summary = JobSummary()
    done_ids, summary.truncated_bytes = recover(opts.output, line_key) if opts.resume else (set(), 0)
    if summary.truncated_bytes:
        print(f"[deepinfer run] {opts.output}: removed a half-written last line ({summary.truncated_bytes} bytes); "
              "its record is redone", file=sys.stderr, flush=True)
    if done_ids:
        print(f"[deepinfer run] resuming: {len(done_ids)} records already in {opts.output}", file=sys.stderr, flush=True)
    progress = Progress(total, already_done=min(len(done_ids), total), log_interval=opts.log_interval,
                        enabled=opts.progress, use_bar=opts.progress_bar)
    writer = ResultWriter(opts.output, ordered=opts.ordered, fsync_interval=opts.fsync_interval)
    written: set[str] = set()

    def todo() -> Iterator[Record]:
        for rec in records:
            if done_ids and record_key(rec) in done_ids:
                writer.skip(rec.seq)
                summary.skipped += 1
                continue
            yield rec

    def on_finished(f: Finished) -> None:
        if f.key in written:
            return  # exactly once: a duplicate report of a retried record
        written.add(f.key)
        writer.write(f.seq, f.line)
        summary.processed += 1
        summary.tokens += f.tokens
        summary.failed += not f.ok
        progress.update(f.ok, f.tokens)

    try:
        execute(todo(), on_finished)
    finally:
        writer.close()
        progress.close()
        summary.elapsed_s = progress.elapsed()
    return summary
