"""DeepInfer as a Ray Data stage (`pip install 'deepinfer[ray]'`).

    import ray.data, deepinfer.ray
    ds = ray.data.read_json("in.jsonl")
    ds.map_batches(**deepinfer.ray.processor(extract, concurrency=2, batch_size=64, num_cpus=1)) \\
      .write_parquet("out/")

`processor(program, model, engine_options, **ray_args)` returns the keyword arguments of
`Dataset.map_batches`: an actor class (`jobs/ray_worker.EngineStage`) holding one `Engine(model,
**engine_options)` per actor that runs `program` (a `@deepinfer.function`, each row's columns its
arguments) or one `SamplingParams` over a `prompt` column. Each output row holds the input columns,
the program's variables (plain values as they are, structured ones as JSON text; a SamplingParams
stage: `generated_text`, `finish_reason`) and `error` (null when the row succeeded): a bad row is
its own error, never the batch's. With `seed`, a row samples from (seed, its `id` column, or its
content when there is none), as a local `deepinfer run` does: its output does not depend on the
actor or the batch. Ray Data restarts a dead actor and retries its batch (its defaults for actor
pools: max_restarts=-1, max_task_retries=-1; pass either to change them).
"""

from __future__ import annotations

import sys
from typing import Any

from deepinfer.jobs.errors import JobUsageError

_MAP_BATCHES_ARGS = {"concurrency", "batch_size", "num_cpus", "num_gpus", "memory", "max_restarts",
                     "max_task_retries", "runtime_env", "resources", "accelerator_type", "scheduling_strategy"}


def require_ray() -> Any:
    """The ray module, or JobUsageError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise JobUsageError("Ray is not installed: pip install 'deepinfer[ray]' (ray[data])") from e
    return ray


def _payload(program: Any) -> bytes:
    """The program pickled by value (its module need not be importable on the actors' nodes)."""
    import ray.cloudpickle as cloudpickle

    module = sys.modules.get(getattr(getattr(program, "func", None), "__module__", "") or "")
    by_value = module is not None and module.__name__ != "__main__" and not module.__name__.startswith("deepinfer")
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(program)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def stage_kind(program: Any) -> str:
    """'program' or 'sampling'; JobUsageError for anything else."""
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.lang.function import Function

    if isinstance(program, Function):
        return "program"
    if isinstance(program, SamplingParams):
        return "sampling"
    raise JobUsageError(f"processor() takes a @deepinfer.function or a SamplingParams, got {type(program).__name__}")


def map_batches_kwargs(spec: Any, ray_args: dict[str, Any]) -> dict[str, Any]:
    """`Dataset.map_batches` keyword arguments running `spec` (a ray_worker.StageSpec)."""
    from deepinfer.jobs.ray_worker import EngineStage

    unknown = sorted(set(ray_args) - _MAP_BATCHES_ARGS)
    if unknown:
        raise JobUsageError(f"unknown Ray argument(s) {', '.join(unknown)} (map_batches takes: "
                            f"{', '.join(sorted(_MAP_BATCHES_ARGS))})")
    conc = ray_args.get("concurrency", 1)
    if not (isinstance(conc, int) and conc >= 1) and not (
            isinstance(conc, tuple) and len(conc) == 2 and all(isinstance(c, int) and c >= 1 for c in conc)):
        raise JobUsageError(f"concurrency must be an int >= 1 (actors) or a (min, max) pair, got {conc!r}")
    bs = ray_args.get("batch_size", 64)
    if not isinstance(bs, int) or bs < 1:
        raise JobUsageError(f"batch_size must be an int >= 1, got {bs!r}")
    for name in ("num_cpus", "num_gpus"):
        v = ray_args.get(name)
        if v is not None and (not isinstance(v, (int, float)) or v < 0):
            raise JobUsageError(f"{name} must be a number >= 0, got {v!r}")
    kw = dict(ray_args)
    kw.update(fn=EngineStage, fn_constructor_kwargs={"spec": spec}, batch_format="pyarrow",
              concurrency=conc, batch_size=bs, zero_copy_batch=True)
    kw.setdefault("num_cpus", 1)
    return kw


def processor(program: Any, model: str | None = None, engine_options: dict[str, Any] | None = None, *,
              seed: int | None = None, sampling: dict[str, Any] | None = None, window: int | None = None,
              **ray_args: Any) -> dict[str, Any]:
    """Keyword arguments for `Dataset.map_batches(**processor(...))` (see the module docstring).

    `sampling`: run-level SamplingParams defaults of every gen (as `deepinfer run --max-tokens ...`);
    `window`: records in flight per actor (default: the batch size); `ray_args`: as map_batches names
    them (`concurrency` = actors, default 1; `batch_size`, default 64; `num_cpus`, default 1;
    `num_gpus`; `max_restarts`, `max_task_retries`, ...). Raises JobUsageError for a bad argument.
    """
    require_ray()
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.jobs.ray_worker import StageSpec

    kind = stage_kind(program)
    sampling = dict(sampling or {})
    try:
        SamplingParams(**sampling)
    except Exception as e:
        raise JobUsageError(f"sampling: {e}") from e
    if engine_options is not None and not isinstance(engine_options, dict):
        raise JobUsageError(f"engine_options must be a dict, got {type(engine_options).__name__}")
    bs = ray_args.get("batch_size", 64)
    window = window if window is not None else bs
    if not isinstance(window, int) or window < 1:
        raise JobUsageError(f"window must be an int >= 1, got {window!r}")
    spec = StageSpec(kind=kind, payload=_payload(program), model=model, engine_options=dict(engine_options or {}),
                     seed=seed, sampling=sampling, window=window, rows="fields", out="columns")
    return map_batches_kwargs(spec, ray_args)
