"""`@deepinfer.function`: a program and its run / run_batch / arun entry points."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from concurrent.futures import Future, as_completed
from typing import Any, Callable, Iterable

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import InvalidRequestError
from deepinfer.lang.backend import get_default_backend
from deepinfer.lang.runtime import Runtime, get_runtime
from deepinfer.lang.state import ProgramState

# Keyword arguments of run/run_batch/arun that set default sampling parameters for every gen
# (unless the program's function itself declares a parameter of that name).
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

DEFAULT_MAX_IN_FLIGHT = 256


class Function:
    """A program: `f(s, ...)` written against a ProgramState; run it with run/run_batch/arun.

    Calling `f(s, *args)` inside another program runs it inline on that program's state.
    """

    def __init__(self, func: Callable) -> None:
        if not callable(func):
            raise InvalidRequestError(f"@function needs a callable, got {type(func).__name__}")
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise InvalidRequestError(f"program {func.__name__!r} must take the state as its first argument")
        self.func = func
        self._sig = inspect.signature(func)
        self._arg_names = {p.name for p in params[1:]}
        functools.update_wrapper(self, func)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        return self.func(s, *args, **kwargs)

    # ------------------------------------------------------------------ helpers
    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        prog, sampling = {}, {}
        for k, v in kwargs.items():
            (sampling if k in SAMPLING_FIELDS and k not in self._arg_names else prog)[k] = v
        return prog, sampling

    @staticmethod
    def _check_defaults(sampling: dict[str, Any]) -> dict[str, Any]:
        unknown = set(sampling) - SAMPLING_FIELDS
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameters {sorted(unknown)}")
        SamplingParams(**sampling)  # bad values fail here, once, for the whole call
        return {k: v for k, v in sampling.items() if v is not None}

    @staticmethod
    def _runtime(backend: Any) -> Runtime:
        return get_runtime(backend if backend is not None else get_default_backend())

    # ------------------------------------------------------------------ entry points
    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run the program once and return its final state (errors are in `state.error()`).

        Keyword arguments named like SamplingParams fields (temperature, max_tokens, ...) are
        defaults for every gen in the program; the rest go to the function. With stream=True
        the state comes back at once; iterate `state.text_iter()` to follow the generation.
        """
        prog_kwargs, sampling = self._split(kwargs)
        defaults = self._check_defaults(sampling)
        batch = self._runtime(backend).submit(self.func, [(args, prog_kwargs)], defaults, window=1, stream=stream)
        if stream:
            return batch.programs[0].state
        return batch.futures[0].result()

    def run_batch(
        self,
        batch_kwargs: Iterable[dict[str, Any]],
        *,
        backend: Any = None,
        progress_bar: bool = False,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        share_prefix: bool = True,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per kwargs dict; states come back in input order.

        At most `max_in_flight` programs are live at once. With share_prefix the longest common
        token prefix of the first wave's first requests is prefilled once before they run.
        One program's error is captured in its state and never stops the others.
        """
        jobs = []
        for i, kw in enumerate(batch_kwargs):
            if not isinstance(kw, dict):
                raise InvalidRequestError(f"run_batch item {i} must be a dict of arguments, got {type(kw).__name__}")
            jobs.append(((), dict(kw)))
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise InvalidRequestError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        defaults = self._check_defaults(sampling)
        if not jobs:
            return []
        batch = self._runtime(backend).submit(
            self.func, jobs, defaults, window=max_in_flight, share_prefix=share_prefix
        )
        if progress_bar:
            from tqdm import tqdm

            with tqdm(total=len(jobs), desc=getattr(self.func, "__name__", "programs")) as bar:
                for _ in as_completed(batch.futures):
                    bar.update(1)
        return [f.result() for f in batch.futures]

    def submit(self, *args: Any, backend: Any = None, **kwargs: Any) -> Future:
        """Start one run without waiting; returns a `concurrent.futures.Future` of its state.

        For streaming many runs through one engine (e.g. an offline job reading a large file):
        keep a window of futures in flight and submit the next run as one finishes. Arguments
        are split as in `run` (sampling-parameter names become per-gen defaults).
        """
        prog_kwargs, sampling = self._split(kwargs)
        defaults = self._check_defaults(sampling)
        return self._runtime(backend).submit(self.func, [(args, prog_kwargs)], defaults, window=1).futures[0]

    async def arun(self, *args: Any, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run the program from asyncio; concurrent `arun` calls share the engine's batches."""
        prog_kwargs, sampling = self._split(kwargs)
        defaults = self._check_defaults(sampling)
        batch = self._runtime(backend).submit(self.func, [(args, prog_kwargs)], defaults, window=1)
        return await asyncio.wrap_future(batch.futures[0])


def function(func: Callable | None = None) -> Any:
    """Decorator turning `def prog(s, ...)` into a Function (usable as @function or @function())."""
    if func is None:
        return Function
    return Function(func)
