"""The offline job: stream records through a program on one engine, writing results as they finish.

A window of at most `batch_size` programs is in flight (submitted one by one with
`Function.submit`, so a finished program's slot is refilled at once and the input is never read
ahead of the window); the engine batches their requests together.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator

from deepinfer.jobs.errors import JobUsageError
from deepinfer.jobs.output import to_jsonable
from deepinfer.jobs.program import program_signature
from deepinfer.jobs.records import Record, check_mapping, check_unique_ids, count_records, id_key, iter_records
from deepinfer.jobs.stream import Executor, JobSummary, run_stream
from deepinfer.jobs.window import Finished, run_window
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


def validate_options(program: Function, opts: JobOptions) -> None:
    """Every check that needs no model: files, option values, argument mapping."""
    check_job_options(opts)
    check_mapping(program_signature(program), opts.mapping, opts.field)
    check_unique_ids(opts.input, opts.limit)
    check_program(program, opts)


def check_job_options(opts: JobOptions) -> None:
    """The checks every job kind shares: input/output files, window, limit, sampling defaults."""
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
    check_batch_options(opts)


def check_batch_options(opts: JobOptions) -> None:
    """The options every job checks alike, local or on Ray: batch size, limit, sampling fields."""
    if not isinstance(opts.batch_size, int) or opts.batch_size < 1:
        raise JobUsageError(f"--batch-size must be an int >= 1, got {opts.batch_size!r}")
    if opts.limit is not None and opts.limit < 0:
        raise JobUsageError(f"--limit must be >= 0, got {opts.limit}")
    from deepinfer.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**opts.sampling)
    except Exception as e:
        raise JobUsageError(str(e)) from e


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


def result_line(rec: Record, state: Any = None, error: BaseException | str | None = None) -> dict[str, Any]:
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


class ProgramTask:
    """A `deepinfer run` record: the program run on its fields (window.Task)."""

    def __init__(self, program: Function, opts: JobOptions, engine: Any) -> None:
        self.program, self.engine, self.seed = program, engine, opts.seed
        self.sig = program_signature(program)
        # sampling defaults must not shadow a program argument of the same name
        self.sampling = {k: v for k, v in opts.sampling.items() if k not in self.sig.names}

    def submit(self, rec: Record) -> Future:
        kw = dict(self.sampling)
        if self.seed is not None and "seed" not in self.sig.names:
            kw["seed"] = _record_seed(self.seed, rec)
        return self.program.submit(backend=self.engine, **{**kw, **rec.kwargs})  # the record's own fields win

    def result(self, rec: Record, value: Any = None, error: BaseException | str | None = None) -> Finished:
        line = result_line(rec, value, error)
        return Finished(rec.seq, rec.key, line, line["ok"], _tokens(value) if value is not None else 0)


def job_records(program: Function, opts: JobOptions) -> Iterator[Record]:
    """The input records of a program job, streamed."""
    return iter_records(opts.input, program_signature(program), opts.mapping, opts.field, opts.limit)


def run_job(program: Function, opts: JobOptions, engine: Any, execute: Executor | None = None) -> JobSummary:
    """Run `program` over every input record on `engine` (or through `execute`, e.g. a Ray
    pool); returns the counts.

    Raises JobUsageError for a bad setup (see validate_options); bad records and failing
    programs become error records instead.
    """
    validate_options(program, opts)
    if execute is None:
        task = ProgramTask(program, opts, engine)

        def execute(records, on_finished):
            run_window(task, records, opts.batch_size, on_finished)

    return run_stream(opts, job_records(program, opts), count_records(opts.input, opts.limit), execute)
