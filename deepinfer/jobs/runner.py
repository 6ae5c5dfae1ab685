"""The offline job: stream records through a program on one engine, writing results as they finish.

A window of at most `batch_size` programs is in flight (submitted one by one with
`Function.submit`, so a finished program's slot is refilled at once and the input is never read
ahead of the window); the engine batches their requests together.
"""

from __future__ import annotations

import os
import sys
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, wait
import dataclasses
from dataclasses import dataclass
from typing import Any

from deepinfer.jobs.errors import JobUsageError
from deepinfer.jobs.output import ResultWriter, recover, to_jsonable
from deepinfer.jobs.program import program_signature
from deepinfer.jobs.progress import Progress
from deepinfer.jobs.records import Record, check_mapping, check_unique_ids, count_records, id_key, iter_records
from deepinfer.lang.function import Function


@dataclass
class JobOptions:
    """What to run and how; `sampling` holds run-level SamplingParams defaults (max_tokens, ...)."""

    input: str
    output: str
    batch_size: int = 64
    limit: int | None = None
    resume: bool = False
    ordered: bool = False
    seed: int | None = None  # per-record seeds derive from it and the record id
    mapping: dict[str, str] = dataclasses.field(default_factory=dict)
    field: str | None = None
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    progress: bool = True
    progress_bar: bool | None = None  # None: a bar when stderr is a terminal
    log_interval: float = 10.0
    fsync_interval: float = 1.0


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


def validate_options(program: Function, opts: JobOptions) -> None:
    """Every check that needs no model: files, option values, argument mapping."""
    if not os.path.isfile(opts.input):
        raise JobUsageError(f"input file {opts.input!r} does not exist")
    if os.path.isdir(opts.output):
        raise JobUsageError(f"output {opts.output!r} is a directory")
    if os.path.abspath(opts.input) == os.path.abspath(opts.output):
        raise JobUsageError("input and output are the same file")
    if not opts.resume and os.path.exists(opts.output) and os.path.getsize(opts.output) > 0:
        raise JobUsageError(
            f"output file {opts.output!r} already has results; pass --resume to continue it, or remove it"
        )
    _check_output_writable(opts.output)
    if not isinstance(opts.batch_size, int) or opts.batch_size < 1:
        raise JobUsageError(f"--batch-size must be an int >= 1, got {opts.batch_size!r}")
    if opts.limit is not None and opts.limit < 0:
        raise JobUsageError(f"--limit must be >= 0, got {opts.limit}")
    check_mapping(program_signature(program), opts.mapping, opts.field)
    check_unique_ids(opts.input, opts.limit)
    from deepinfer.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**opts.sampling)
    except Exception as e:
        raise JobUsageError(str(e)) from e
    check_program(program, opts)


def check_program(program: Function, opts: JobOptions) -> None:
    """The compiler's ahead-of-time checks, traced on the first input record: errors of program
    lines that no argument changes (so every record would fail) stop the job before the model loads."""
    from deepinfer.lang.compiler import check_graph
    from deepinfer.lang.trace import trace_function

    sig = program_signature(program)
    first = next(iter_records(opts.input, sig, opts.mapping, opts.field, 1), None)
    if first is None or first.error is not None:
        return
    sampling = {k: v for k, v in opts.sampling.items() if k not in sig.names}
    try:
        result = trace_function(program.func, (), first.kwargs)
    except Exception:  # the record does not fit the program: that record's own error when it runs
        return
    errors = check_graph(result, sampling, varying=set(result.graph.arguments))
    if errors:
        raise JobUsageError(f"program check failed: {errors[0]}")


def _check_output_writable(path: str) -> None:
    """Open the output for appending now, so a path that cannot be written (a missing directory, a
    file used as a directory, /proc) is a usage error before the model loads, not a traceback
    after. A file this check creates is removed again."""
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise JobUsageError(f"cannot write the output file {path!r}: {e.strerror or e}") from e
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass


def _tokens(state: Any) -> int:
    """Generated tokens of a finished program (gens only; select scores without generating)."""
    n = 0
    for name in state.variables():
        try:
            meta = state.get_meta_info(name)
        except KeyError:
            continue
        for m in meta if isinstance(meta, list) else [meta]:
            if isinstance(m, dict):
                n += int(m.get("completion_tokens") or 0)
    return n


def _result(rec: Record, state: Any = None, error: BaseException | str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rec.id, "line": rec.line}
    if rec.implicit_id:
        out["implicit_id"] = True  # its id is the line number: --resume matches it by line
    if state is not None and error is None:
        error = state.error()
    out["ok"] = error is None
    if state is not None:
        try:
            out["variables"] = to_jsonable(state.variables())
        except Exception as e:  # an unencodable value must not lose the record
            out["variables"] = {}
            error = error or e
            out["ok"] = False
    if error is not None:
        out["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return out


def _record_seed(seed: int, rec: Record) -> int:
    # a record's sampling must not depend on which records share its batch
    return zlib.crc32(f"{seed}:{id_key(rec.id)}".encode()) & 0x7FFFFFFF


def run_job(program: Function, opts: JobOptions, engine: Any) -> JobSummary:
    """Run `program` over every input record on `engine`; returns the counts.

    Raises JobUsageError for a bad setup (see validate_options); bad records and failing
    programs become error records instead.
    """
    validate_options(program, opts)
    sig = program_signature(program)
    summary = JobSummary()
    done_ids, summary.truncated_bytes = recover(opts.output) if opts.resume else (set(), 0)
    if summary.truncated_bytes:
        print(f"[deepinfer run] {opts.output}: removed a half-written last line ({summary.truncated_bytes} bytes); "
              "its record is redone", file=sys.stderr, flush=True)
    if done_ids:
        print(f"[deepinfer run] resuming: {len(done_ids)} records already in {opts.output}", file=sys.stderr, flush=True)
    total = count_records(opts.input, opts.limit)
    progress = Progress(total, already_done=min(len(done_ids), total), log_interval=opts.log_interval,
                        enabled=opts.progress, use_bar=opts.progress_bar)
    # sampling defaults must not shadow a program argument of the same name
    sampling = {k: v for k, v in opts.sampling.items() if k not in sig.names}
    writer = ResultWriter(opts.output, ordered=opts.ordered, fsync_interval=opts.fsync_interval)
    in_flight: dict[Future, Record] = {}

    def finish(rec: Record, result: dict[str, Any], tokens: int) -> None:
        writer.write(rec.seq, result)
        summary.processed += 1
        summary.tokens += tokens
        summary.failed += not result["ok"]
        progress.update(result["ok"], tokens)

    def reap(block: bool) -> None:
        if not in_flight:
            return
        finished, _ = wait(list(in_flight), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for fut in finished:
            rec = in_flight.pop(fut)
            try:
                state = fut.result()
            except Exception as e:  # the runtime itself failed this program
                finish(rec, _result(rec, error=e), 0)
                continue
            finish(rec, _result(rec, state), _tokens(state))

    try:
        for rec in iter_records(opts.input, sig, opts.mapping, opts.field, opts.limit):
            if done_ids and rec.key in done_ids:
                writer.skip(rec.seq)
                summary.skipped += 1
                continue
            if rec.error is not None:
                finish(rec, _result(rec, error=rec.error), 0)
                continue
            kw = dict(sampling)
            if opts.seed is not None and "seed" not in sig.names:
                kw["seed"] = _record_seed(opts.seed, rec)
            try:
                fut = program.submit(backend=engine, **{**kw, **rec.kwargs})  # the record's own fields win
            except Exception as e:
                finish(rec, _result(rec, error=e), 0)
                continue
            in_flight[fut] = rec
            while len(in_flight) >= opts.batch_size:
                reap(block=True)
        while in_flight:
            reap(block=True)
    finally:
        writer.close()
        progress.close()
        summary.elapsed_s = progress.elapsed()
    return summary
