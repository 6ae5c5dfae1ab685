"""The Ray actor of a `--ray` job: one Engine, blocks of records through the local job window.

Kept apart from `jobs/ray.py` (the driver) because it runs in the actor processes; the actor class
is built on first use so importing deepinfer never needs ray.
"""

from __future__ import annotations

import os
from typing import Any

from deepinfer.jobs.records import Record
from deepinfer.jobs.window import Finished, run_window


class EngineWorker:
    """Builds the engine and the job's task once; `run_block` runs records, possibly from several
    threads at once (the actor's max_concurrency): the engine driver / program runtime behind the
    task is the one thread that touches the engine."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from deepinfer.engine.engine import Engine

        opts = spec["opts"]
        self.window = spec["window"]
        self.engine = Engine(spec["model"], **spec["engine_options"])
        if spec["kind"] == "batch":
            from deepinfer.jobs.batch_runner import BatchTask, model_name
            from deepinfer.jobs.engine_driver import EngineDriver

            self.driver = EngineDriver(self.engine)
            self.task = BatchTask(self.driver, opts, model_name(self.engine, spec["model"]), self.engine.tokenizer)
        else:
            from deepinfer.jobs.program import load_program
            from deepinfer.jobs.runner import ProgramTask

            self.task = ProgramTask(load_program(spec["program"]), opts, self.engine)

    def ready(self) -> int:
        return os.getpid()

    def run_block(self, records: list[Record]) -> list[Finished]:
        out: list[Finished] = []
        run_window(self.task, iter(records), self.window, out.append)
        return out


_cls: Any = None


def worker_class(ray: Any) -> Any:
    """EngineWorker as a Ray actor class (made once per process)."""
    global _cls
    if _cls is None:
        _cls = ray.remote(EngineWorker)
    return _cls


def error_results(kind: str, block: list[Record], why: str) -> list[Finished]:
    """Error records for a block no replica could run (made on the driver, without an engine)."""
    if kind == "batch":
        from deepinfer.jobs.batch_runner import batch_record_key
        from deepinfer.jobs.openai_format import error_line

        return [Finished(r.seq, batch_record_key(r), error_line(r, RuntimeError(why)), False, 0) for r in block]
    from deepinfer.jobs.runner import result_line

    return [Finished(r.seq, r.key, result_line(r, error=why), False, 0) for r in block]
