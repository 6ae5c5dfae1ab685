"""`deepinfer run-batch`: an OpenAI batch file through one engine (or a Ray pool), with the same
window, resume, progress and exactly-once writing as `deepinfer run` (`window`, `stream`)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Iterator

from deepinfer.jobs.engine_driver import EngineDriver
from deepinfer.jobs.openai_batch import choices_per_prompt, engine_requests, to_batch_record
from deepinfer.jobs.openai_format import batch_line_id, completion_line, error_line, line_key
from deepinfer.jobs.records import Record, check_unique_ids, count_records, nonblank_lines
from deepinfer.jobs.runner import JobOptions, check_job_options
from deepinfer.jobs.stream import Executor, JobSummary, run_stream
from deepinfer.jobs.window import Finished, run_window


def validate_batch_options(opts: JobOptions) -> None:
    """Every check that needs no model (files, options, unique custom_ids)."""
    check_job_options(opts)
    check_unique_ids(opts.input, opts.limit, id_field="custom_id")


def batch_records(opts: JobOptions) -> Iterator[Record]:
    for seq, (line_no, raw) in enumerate(nonblank_lines(opts.input, opts.limit)):
        yield to_batch_record(seq, line_no, raw)


def batch_record_key(rec: Record) -> str:
    return batch_line_id(rec.key)


def model_name(engine: Any, fallback: str | None = None) -> str:
    import os

    path = getattr(getattr(engine, "config", None), "model", None) or fallback or "deepinfer"
    return os.path.basename(str(path).rstrip("/")) or str(path)


class BatchTask:
    """A run-batch record: its body's requests on the engine driver (window.Task)."""

    def __init__(self, driver: EngineDriver, opts: JobOptions, model: str, tokenizer: Any) -> None:
        self.driver, self.seed, self.model = driver, opts.seed, model
        self.defaults = {k: v for k, v in opts.sampling.items() if k != "complete_within_budget"}
        self._tok = tokenizer
        self._pending: dict[int, tuple[str, int]] = {}  # seq -> (url, n)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def submit(self, rec: Record) -> Future:
        url, body = rec.kwargs["url"], rec.kwargs["body"]
        reqs = engine_requests(url, body, rec.id, self.seed, self.defaults)
        self._pending[rec.seq] = (url, choices_per_prompt(body))
        return self.driver.submit(reqs)

    def result(self, rec: Record, value: Any = None, error: BaseException | str | None = None) -> Finished:
        url, n = self._pending.pop(rec.seq, (None, 1))
        if error is None:
            failed = [o for o in value if o.finish_reason in ("error", "abort")]
            if failed:
                error = RuntimeError(f"engine request ended with {failed[0].finish_reason}: {failed[0].error}")
        if error is not None:
            return Finished(rec.seq, batch_record_key(rec), error_line(rec, error), False, 0)
        line = completion_line(rec, url, value, n, self.model, self.token_text)
        return Finished(rec.seq, batch_record_key(rec), line, True, sum(len(o.token_ids) for o in value))


def run_batch_job(opts: JobOptions, engine: Any = None, execute: Executor | None = None,
                  model: str | None = None) -> JobSummary:
    """Run an OpenAI batch file on `engine` (or through `execute`, e.g. a Ray pool)."""
    validate_batch_options(opts)
    records = batch_records(opts)
    total = count_records(opts.input, opts.limit)
    if execute is not None:
        return run_stream(opts, records, total, execute, batch_record_key, line_key)
    with EngineDriver(engine) as driver:
        task = BatchTask(driver, opts, model_name(engine, model), engine.tokenizer)

        def local(recs, on_finished):
            run_window(task, recs, opts.batch_size, on_finished)

        return run_stream(opts, records, total, local, batch_record_key, line_key)
