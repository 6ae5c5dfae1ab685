"""The Ray Data stage: an actor class `map_batches` runs, holding one Engine, that turns a batch of
rows into a batch of results (`EngineStage.__call__`, pyarrow in, pyarrow out).

It runs in the actor processes; nothing here imports ray at module level, so importing deepinfer
never needs it. Records go through the local job's window (`window.run_window`) and tasks
(`runner.ProgramTask`, `batch_runner.BatchTask`), so a record's seed, output line and error line
are the local job's: seeds derive from (seed, record id), never from the actor or the batch.

Rows come in one of two shapes (`StageSpec.rows`):
- "fields": a user's dataset, each column a program argument (`id`, when present, is the record id);
- "lines": `deepinfer run --ray`'s reader, one input line per row (`raw`, `line`, `source`), parsed
  here exactly as the local job parses a line (so a bad line is that record's error line).
and go out as (`StageSpec.out`):
- "columns": the input columns, the program's variables (str/int/float/bool as they are, anything
  else as JSON text) and `error` (null when the record succeeded);
- "lines": `key`, `result` (the local job's output line, JSON), `ok`, `tokens` (for the shard writer).
One bad row never fails the batch: it becomes its row's `error`.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from deepinfer.jobs.errors import JobUsageError
from deepinfer.jobs.records import Record, id_key, to_record
from deepinfer.jobs.window import Finished, run_window

ROWS = ("fields", "lines")
OUTS = ("columns", "lines")


@dataclass
class StageSpec:
    """What every actor of one stage builds and runs (pickled once, sent to each actor)."""

    kind: str  # "program", "sampling" (plain SamplingParams over a `prompt` column) or "batch" (OpenAI)
    payload: bytes | None  # cloudpickle of the program / SamplingParams (by value); None for "batch"
    model: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # run-level SamplingParams defaults
    mapping: dict[str, str] = field(default_factory=dict)
    field_name: str | None = None  # --field: each whole line is this one argument
    window: int = 64  # records in flight per actor (the local job's --batch-size)
    rows: str = "fields"
    out: str = "columns"
    multi_input: bool = False  # several input files: an implicit (line-number) id would be ambiguous
    done: Any = None  # ObjectRef of the keys already written (resume); skipped rows are dropped


class _SamplingTask:
    """A `prompt` row generated with one SamplingParams (window.Task), through the engine driver."""

    def __init__(self, driver: Any, params: Any, seed: int | None, defaults: dict[str, Any]) -> None:
        self.driver, self.params, self.seed = driver, params, seed
        self.defaults = {k: v for k, v in defaults.items() if k != "complete_within_budget"}

    def submit(self, rec: Record) -> Future:
        import dataclasses

        from deepinfer.jobs.runner import _record_seed as record_seed

        prompt = rec.kwargs.get("prompt")
        if not isinstance(prompt, (str, list)):
            raise JobUsageError(f"row needs a `prompt` column (a string or token ids), got {type(prompt).__name__}")
        params = self.params
        changes = {k: v for k, v in self.defaults.items() if hasattr(params, k)}
        if self.seed is not None:
            changes["seed"] = record_seed(self.seed, rec)
        if changes:
            params = dataclasses.replace(params, **changes)
        return self.driver.submit([(prompt, params)])

    def result(self, rec: Record, value: Any = None, error: BaseException | str | None = None) -> Finished:
        from deepinfer.jobs.runner import result_line

        variables: dict[str, Any] = {}
        if value is not None:
            out = value[0]
            variables = {"generated_text": out.text, "finish_reason": out.finish_reason}
            if out.finish_reason in ("error", "abort") and error is None:
                error = f"engine request ended with {out.finish_reason}: {out.error}"
        line = result_line(rec, error=error)
        line["variables"] = variables
        return Finished(rec.seq, rec.key, line, error is None, len(value[0].token_ids) if value else 0)


class EngineStage:
    """One engine; `__call__(batch)` runs the batch's records (Ray Data calls it once per batch)."""

    def __init__(self, spec: StageSpec) -> None:
        from deepinfer.engine.engine import Engine

        self.spec = spec
        self.engine = Engine(spec.model, **spec.engine_options)
        self.driver = None
        self.sig = None
        if spec.kind == "batch":
            from deepinfer.jobs.batch_runner import BatchTask, model_name
            from deepinfer.jobs.engine_driver import EngineDriver
            from deepinfer.jobs.runner import JobOptions

            self.driver = EngineDriver(self.engine)
            opts = JobOptions(input="", output="", seed=spec.seed, sampling=dict(spec.sampling))
            self.task = BatchTask(self.driver, opts, model_name(self.engine, spec.model), self.engine.tokenizer)
        else:
            import ray.cloudpickle as cloudpickle

            obj = cloudpickle.loads(spec.payload)
            if spec.kind == "sampling":
                from deepinfer.jobs.engine_driver import EngineDriver
                from deepinfer.jobs.program import ProgramSignature

                self.driver = EngineDriver(self.engine)
                self.task = _SamplingTask(self.driver, obj, spec.seed, spec.sampling)
                self.sig = ProgramSignature(("prompt",), (), True)
            else:
                from deepinfer.jobs.program import program_signature
                from deepinfer.jobs.runner import JobOptions, ProgramTask

                opts = JobOptions(input="", output="", seed=spec.seed, sampling=dict(spec.sampling))
                self.task = ProgramTask(obj, opts, self.engine)
                self.sig = program_signature(obj)
        self.done: frozenset[str] = frozenset()
        if spec.done is not None:
            import ray

            self.done = frozenset(ray.get(spec.done))

    def __call__(self, batch: Any) -> Any:
        rows = batch.to_pylist()
        records = [self._record(i, row) for i, row in enumerate(rows)]
        keep = [i for i, r in enumerate(records) if self._key(r) not in self.done]
        results: dict[int, Finished] = {}
        run_window(self.task, (records[i] for i in keep), self.spec.window,
                   lambda f: results.__setitem__(f.seq, f))
        missing = [i for i in keep if i not in results]
        if missing:  # the window reports every record; if not, say so rather than drop it
            for i in missing:
                results[i] = self.task.result(records[i], error="the record finished without a result")
        if self.spec.out == "lines":
            return _lines_table([results[i] for i in keep], self.spec.kind)
        return _columns_table([rows[i] for i in keep], [results[i] for i in keep], self.spec.kind)

    def _key(self, rec: Record) -> str:
        if self.spec.kind == "batch":
            from deepinfer.jobs.batch_runner import batch_record_key

            return batch_record_key(rec)
        return rec.key

    def _record(self, seq: int, row: dict[str, Any]) -> Record:
        spec = self.spec
        if spec.rows == "lines" and "raw" in row:
            line = int(row.get("line") or 0)
            if spec.kind == "batch":
                from deepinfer.jobs.openai_batch import to_batch_record

                rec = to_batch_record(seq, line, row["raw"])
            else:
                rec = to_record(seq, line, row["raw"], self.sig, spec.mapping, spec.field_name)
        else:  # a row of columns: a user's dataset, or a Parquet input
            rec = self._record_of_fields(seq, row)
        if rec.implicit_id and spec.multi_input and rec.error is None:
            rec.error = (f"record at line {rec.line} of {row.get('source')} has no `id`; with several input "
                         "files every record needs one (line numbers repeat across files)")
        return rec

    def _record_of_fields(self, seq: int, row: dict[str, Any]) -> Record:
        spec = self.spec
        if spec.kind == "batch":
            raw = json.dumps(row, ensure_ascii=False, default=str)
            from deepinfer.jobs.openai_batch import to_batch_record

            return to_batch_record(seq, 0, raw)
        if "id" in row and row["id"] is not None:
            rid, implicit = row["id"], False
        else:
            # no id column: the row's own content is its identity, so its seed does not depend on
            # the actor, the batch or the row's position
            rid, implicit = id_key({k: v for k, v in row.items()}), False
        if spec.field_name is not None:
            return Record(seq, 0, rid, {spec.field_name: row})
        fields = {spec.mapping.get(k, k): v for k, v in row.items()}
        missing = [n for n in self.sig.required if n not in fields or fields[n] is None]
        if missing:
            return Record(seq, 0, rid, None, f"row lacks program argument(s) {', '.join(map(repr, missing))} "
                          f"(its columns: {', '.join(sorted(row)) or 'none'})", implicit_id=implicit)
        kwargs = fields if self.sig.var_keyword else {k: v for k, v in fields.items() if k in self.sig.names}
        return Record(seq, 0, rid, kwargs, implicit_id=implicit)


def _lines_table(results: list[Finished], kind: str) -> Any:
    import pyarrow as pa

    return pa.table({
        "key": pa.array([f.key for f in results], pa.string()),
        "result": pa.array([json.dumps(f.line, ensure_ascii=False, separators=(",", ":")) for f in results],
                           pa.string()),
        "ok": pa.array([bool(f.ok) for f in results], pa.bool_()),
        "tokens": pa.array([int(f.tokens) for f in results], pa.int64()),
    })


_PLAIN = (str, bool, int, float)


def _column(values: list[Any]) -> Any:
    """A column of variables: plain when every value is one plain type (or null), else JSON text."""
    import pyarrow as pa

    types = {type(v) for v in values if v is not None}
    if not types:
        return pa.array(values, pa.string())
    if len(types) == 1 and types.pop() in _PLAIN:
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, OverflowError):
            pass
    return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())


def _columns_table(rows: list[dict[str, Any]], results: list[Finished], kind: str) -> Any:
    import pyarrow as pa

    if kind == "batch":
        return pa.table({
            "custom_id": pa.array([f.line.get("custom_id") for f in results], pa.string()),
            "response": _column([f.line.get("response") for f in results]),
            "error": pa.array([None if f.ok else json.dumps(f.line.get("error")) for f in results], pa.string()),
        })
    names: list[str] = []
    for f in results:
        for k in f.line.get("variables") or {}:
            if k not in names:
                names.append(k)
    cols: dict[str, Any] = {}
    input_names = list(rows[0]) if rows else []
    for k in input_names:
        if k not in names and k != "error":
            cols[k] = pa.array([r.get(k) for r in rows])
    for k in names:
        cols[k] = _column([(f.line.get("variables") or {}).get(k) for f in results])
    cols["error"] = pa.array([f.line.get("error") for f in results], pa.string())
    return pa.table(cols)
