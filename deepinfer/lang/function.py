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
from deepinfer.lang.compiler import check_graph, plan_batch
from deepinfer.lang.graph import Graph
from deepinfer.lang.runtime import Runtime, get_runtime
from deepinfer.lang.state import ProgramState
from deepinfer.lang.trace import trace_function

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

    # ------------------------------------------------------------------ compiler
    def trace(self, *args: Any, **kwargs: Any) -> Graph:
        """The program's graph, traced with these example arguments (no model needed; see trace.py)."""
        return trace_function(self.func, args, kwargs).graph

    def graph(self, *args: Any, format: str = "text", **kwargs: Any) -> str:
        """`trace(...)` rendered as text (format="text") or Graphviz dot (format="dot")."""
        if format not in ("text", "dot"):
            raise InvalidRequestError(f"graph format must be 'text' or 'dot', got {format!r}")
        g = self.trace(*args, **kwargs)
        return g.to_dot() if format == "dot" else g.to_text()

    def check(self, *args: Any, **kwargs: Any) -> None:
        """Ahead-of-time checks with these example arguments; raises ProgramCheckError naming the
        program line of the first problem (undefined variable, select without choices, invalid
        regex / schema, unknown or bad sampling arguments). Keyword arguments named like
        SamplingParams fields are run-level defaults, as in `run`."""
        prog_kwargs, sampling = self._split(kwargs)
        defaults = self._check_defaults(sampling)
        errors = check_graph(trace_function(self.func, args, prog_kwargs), defaults)
        if errors:
            raise errors[0]

    def bind(self, **kwargs: Any) -> "Function":
        """A copy of this program with some arguments fixed (SGLang's `Function.bind`)."""
        unknown = [k for k in kwargs if k not in self._arg_names]
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in self._sig.parameters.values()):
            raise InvalidRequestError(f"bind: program {self.func.__name__!r} has no argument(s) {unknown}")
        return Function(functools.partial(self.func, **kwargs))

    def _plan(self, jobs: list, defaults: dict, runtime: Runtime, share_prefix: bool) -> tuple[list | None, bool]:
        """Compile the batch (compiler.plan_batch); returns (the static prefix leaves to share, whether
        the first program runs alone until the engine's first step)."""
        plan = plan_batch(self.func, jobs, defaults, runtime.backend, share_prefix)
        return (plan.probes if plan.prefix else None), plan.first_alone

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
    def run(self, *args: Any, stream: bool = False, backend: Any = None, compile: bool = True,
            **kwargs: Any) -> ProgramState:
        """Run the program once and return its final state (errors are in `state.error()`).

        Keyword arguments named like SamplingParams fields (temperature, max_tokens, ...) are
        defaults for every gen in the program; the rest go to the function. With stream=True
        the state comes back at once; iterate `state.text_iter()` to follow the generation.
        """
        prog_kwargs, sampling = self._split(kwargs)
        defaults = self._check_defaults(sampling)
        runtime = self._runtime(backend)
        if compile:
            self._plan([(args, prog_kwargs)], defaults, runtime, False)
        batch = runtime.submit(self.func, [(args, prog_kwargs)], defaults, window=1, stream=stream)
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
        compile: bool = True,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per item (a dict of keyword arguments, or a tuple / list of
        positional ones); states come back in input order.

        At most `max_in_flight` programs are live at once. With compile (the default) the
        program is traced first: the text no varying argument changes is prefilled once for the
        batch (with share_prefix) and every distinct constraint starts compiling at once
        (compiler.py). compile=False runs purely interpreted: then with share_prefix the longest
        common token prefix of the first wave's first requests is prefilled once before they run.
        One program's error is captured in its state and never stops the others.
        """
        jobs = []
        for i, kw in enumerate(batch_kwargs):
            if isinstance(kw, dict):
                jobs.append(((), dict(kw)))
            elif isinstance(kw, (tuple, list)):
                jobs.append((tuple(kw), {}))
            else:
                raise InvalidRequestError(
                    f"run_batch item {i} must be a dict of arguments or a tuple of positional ones, "
                    f"got {type(kw).__name__}")
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise InvalidRequestError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        defaults = self._check_defaults(sampling)
        if not jobs:
            return []
        runtime = self._runtime(backend)
        prefix, first_alone = self._plan(jobs, defaults, runtime, share_prefix) if compile else (None, False)
        batch = runtime.submit(self.func, jobs, defaults, window=max_in_flight, share_prefix=share_prefix,
                               prefix=prefix, first_alone=first_alone)
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

    async def arun(self, *args: Any, backend: Any = None, compile: bool = True, **kwargs: Any) -> ProgramState:
        """Run the program from asyncio; concurrent `arun` calls share the engine's batches."""
        prog_kwargs, sampling = self._split(kwargs)
        defaults = self._check_defaults(sampling)
        runtime = self._runtime(backend)
        if compile:
            self._plan([(args, prog_kwargs)], defaults, runtime, False)
        batch = runtime.submit(self.func, [(args, prog_kwargs)], defaults, window=1)
        return await asyncio.wrap_future(batch.futures[0])


def function(func: Callable | None = None) -> Any:
    """Decorator turning `def prog(s, ...)` into a Function (usable as @function or @function())."""
    if func is None:
        return Function
    return Function(func)
