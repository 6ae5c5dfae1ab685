"""The engine adapter: the only file of deepinfer.lang that calls the engine.

The runtime needs the engine's step-level API (add_request / step / abort / has_unfinished) and
its tokenizer; everything goes through `EngineBackend`, so wiring a different engine means
changing this file only. Also holds the process-wide default backend.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable

from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.lang.chat_template import RoleFormat, analyze_chat_template
from deepinfer.lang.token_cache import SegmentEncoder


def constraint_key(p: Any) -> tuple:
    """Hashable identity of a request's constraint (equal keys compile to the same grammar)."""
    return tuple(repr(getattr(p, k, None)) for k in ("regex", "json_schema", "grammar", "choices", "dtype", "json_object"))

_ids = itertools.count()


class _Alarm:
    """One daemon thread that runs callbacks after a delay. threading.Timer starts a thread per call,
    and Thread.start waits until the new thread has run: 6-7 ms on the 2-core host while a grammar
    compile held both cores, on the path to a compiled batch's first request (precompile_after)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deepinfer-alarm", daemon=True)
                self._thread.start()

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.start()
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._order), fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                fn = heapq.heappop(self._heap)[2]
            try:
                fn()
            except Exception:  # one failed callback must not end the alarms of every later batch
                logging.getLogger(__name__).exception("deepinfer-alarm callback failed")


_alarm = _Alarm()


def _new_alarm_in_child() -> None:  # a forked child has no such thread: it starts its own when needed
    global _alarm
    _alarm = _Alarm()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_alarm_in_child)


class EngineBackend:
    """Wraps one engine for the program runtime: token helpers plus request submission/stepping."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._role_format: RoleFormat | None = None
        self._encoder: SegmentEncoder | None = None
        self._compiles: dict[tuple, Any] = {}  # constraint key -> Future of its precompile
        self._params: dict[tuple, SamplingParams] = {}  # make_params cache
        self._compiles_lock = threading.Lock()
        self._held: set[int] = set()  # ids of precompile_after proxies whose compile has not started
        # precompile_after passes whose constraints are not listed yet (a callable, run at their start):
        # meanwhile a constrained request with no compile on record is held, as it may be one of them
        self._deferred = 0
        self._gates: list[Future] = []  # resolved after the next engine step (precompile_after)
        # the engine queues a request whose constraint still compiles when nothing else runs, and
        # prefills it meanwhile (Engine.prefills_while_compiling): see compile_in_flight
        self.prefills_while_compiling = bool(getattr(engine, "prefills_while_compiling", False))
        if self.prefills_while_compiling:
            _alarm.start()  # now, not on a batch's path to its first request
        # ids that end generation: the engine may add the model config's to the tokenizer's
        eos = list(getattr(self.tokenizer, "eos_token_ids", None) or [])
        eos += list(getattr(engine, "eos_token_ids", None) or [])
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in eos)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        self.bos_token_id: int | None = bos if getattr(self.tokenizer, "add_bos", False) else None

    # ---------------------------------------------------------------- tokenizer
    @property
    def role_format(self) -> RoleFormat:
        """Per-role chat text, derived from the tokenizer's chat template on first use."""
        if self._role_format is None:
            self._role_format = analyze_chat_template(self.tokenizer)
        return self._role_format

    def encode(self, text: str) -> list[int]:
        """tokenizer.encode(text, add_special_tokens=False), with the pieces every program shares
        (chat markup, fixed text) encoded once (token_cache.py)."""
        enc = self._encoder
        if enc is None:
            try:
                fmt = self.role_format
                markup = [*fmt.start.values(), *fmt.prefix.values(), *fmt.suffix.values()]
            except Exception:  # no usable chat template: roles fail on their own; no markers here
                markup = []
            enc = self._encoder = SegmentEncoder(self.tokenizer, markup)
        return enc.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # ---------------------------------------------------------------- requests
    def make_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams from keyword fields (raises InvalidRequestError for bad values).

        Equal fields give the same (never mutated) object: building and validating SamplingParams
        was ~1/3 of the frontend's time per gen on the FakeEngine benchmark. Fields with
        unhashable values (a schema dict) are built each time.
        """
        try:
            key = tuple((k, type(v), tuple(v) if type(v) is list else v) for k, v in sorted(fields.items()))
            hit = self._params.get(key)
        except TypeError:
            return SamplingParams(**fields)
        if hit is None:
            hit = SamplingParams(**fields)
            if len(self._params) >= 4096:
                self._params.clear()
            self._params[key] = hit
        return hit

    def precompile(self, params: SamplingParams) -> bool:
        """Start compiling params' constraint ahead of its request (engines with `precompile`);
        True when a compile was started. `compiling(params)` then says whether it still runs."""
        fn = getattr(self.engine, "precompile", None)
        fut = fn(params) if fn is not None else None
        if fut is None:
            return False
        with self._compiles_lock:
            self._compiles[constraint_key(params)] = fut
        return True

    def compile_futures(self, params_list: list[SamplingParams]) -> list[Any]:
        """The running precompiles (futures) of params_list's constraints."""
        with self._compiles_lock:
            futs = [self._compiles.get(constraint_key(p)) for p in params_list]
        return [f for f in futs if f is not None]

    def precompile_after(self, after: list[Any], params_list: list[SamplingParams] | Callable[[], list[SamplingParams]],
                         wait_s: float = 0.5, in_flight: int = 2, after_step: bool = True) -> int:
        """`precompile` params_list once every future in `after` is done and (with `after_step`) the
        engine's next step has returned, `in_flight` at a time, each next one as one finishes: the
        first program's constraints compile first, alone, and its first step runs with no compile
        beside it. Meanwhile each counts as compiling, so the runtime holds its requests rather
        than let the engine compile it on the spot. If `after` is not done within `wait_s` seconds
        (a slow first schema), they start then. Returns how many (0 for a callable).

        params_list may be a callable that lists them, called at that start: the compiler's trace of
        every later program then runs after the first step, not before the first request (100
        programs with distinct schemas: ~40 ms of tracing and spec building that delayed the batch's
        first output). Until it has run, every constrained request with no compile on record counts
        as compiling (held).

        Started together, 100 fresh schemas shared the CPU with the first one and the batch's first
        output came 2.8x later than interpreted (265 vs 95 ms, tiny model, where the interpreted
        runtime compiled the first schema alone, in 23 ms); started all at once when the first was
        done, their spec building (18 ms) delayed the first request's submission. Started when the
        first was done, two compiles ran beside the first step: a 1-token request took 920-1320 ms
        with two compile threads busy against 320-370 ms without (2 loaded cores), and the first
        output waited on that step. `wait_s` was 0.1 s, but on loaded cores the first schema's
        compile (23 ms quiet) overran it (its request went in at 505 ms) and the rest started beside
        the first step. `in_flight` is the engine's compile threads (GrammarCompiler's default 2)."""
        fn = getattr(self.engine, "precompile", None)
        lazy = callable(params_list)
        if fn is None or not (lazy or params_list):
            return 0
        pending = [f for f in after if not f.done()]
        gate = self._next_step_gate() if after_step else None
        queue: list[tuple[SamplingParams, Future]] = []

        def enqueue(params: list[SamplingParams], held: bool) -> None:
            with self._compiles_lock:
                for p in params:
                    proxy: Future = Future()
                    self._compiles[constraint_key(p)] = proxy
                    if held:
                        self._held.add(id(proxy))
                    queue.append((p, proxy))

        if lazy:
            with self._compiles_lock:
                self._deferred += 1
        else:
            enqueue(params_list, held=True)
        lock = threading.Lock()
        started = [False]

        def next_one() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    p, proxy = queue.pop(0)
                try:
                    fut = fn(p)
                except Exception:  # its request reports the error on its own
                    fut = None
                if fut is None or fut.done():  # (a done one is not chained: no recursion through callbacks)
                    _settle(proxy, fut)
                    continue
                fut.add_done_callback(lambda f, proxy=proxy: (_settle(proxy, f), next_one()))
                return

        def start(force: bool = False) -> None:
            with lock:
                if started[0]:
                    return
                if not force and (any(not f.done() for f in pending) or (gate is not None and not gate.done())):
                    return
                started[0] = True
            if lazy:
                try:
                    listed = params_list()
                except Exception:  # a program's own error: its requests compile when they are submitted
                    listed = []
                with lock:
                    enqueue(listed, held=False)
                with self._compiles_lock:
                    self._deferred -= 1
            with self._compiles_lock:
                self._held.difference_update(id(proxy) for _, proxy in queue)
            for _ in range(max(1, in_flight)):
                next_one()

        for f in pending:
            f.add_done_callback(lambda _f: start())
        if gate is not None:
            gate.add_done_callback(lambda _f: start())
        if pending:  # a slow first compile holds the rest back at most wait_s
            _alarm.after(wait_s, lambda: start(force=any(not f.done() for f in pending)))
        start()
        return 0 if lazy else len(params_list)

    def _next_step_gate(self) -> Future:
        """A future resolved when the engine's next step returns (or when nothing can step: see
        wait_compiles)."""
        gate: Future = Future()
        with self._compiles_lock:
            self._gates.append(gate)
        return gate

    def _open_gates(self) -> None:
        with self._compiles_lock:
            gates, self._gates = self._gates, []
        for g in gates:
            g.set_result(None)

    def compile_in_flight(self, params: SamplingParams) -> Future | None:
        """The running compile of params' constraint that an engine which prefills while compiling
        can take the request beside (the runtime then submits it instead of holding it, when
        nothing else is in flight): a started, unfinished precompile. None otherwise: the engine
        lacks that, no compile is on record, or it is held for the first step (precompile_after)."""
        if not self.prefills_while_compiling or not params.constrained:
            return None
        with self._compiles_lock:
            fut = self._compiles.get(constraint_key(params))
            if fut is None or fut.done() or id(fut) in self._held:
                return None
        return fut

    def compiling(self, params: SamplingParams) -> bool:
        """True while a precompile of params' constraint is still running (its request would wait)."""
        if not params.constrained or not (self._compiles or self._deferred):
            return False
        key = constraint_key(params)
        with self._compiles_lock:
            fut = self._compiles.get(key)
            if fut is None:
                return self._deferred > 0  # a deferred pass may list it: hold it till then
            if fut.done():
                del self._compiles[key]
                return False
        return True

    def wait_compiles(self, timeout: float, params_list: list[SamplingParams]) -> None:
        """Block until the precompile of one of params_list's constraints (the held requests')
        finishes, or `timeout` seconds pass. If all of them are held for an engine step
        (precompile_after) that cannot come, as nothing else is in flight, they start now."""
        from concurrent.futures import FIRST_COMPLETED, wait

        with self._compiles_lock:
            futs = [self._compiles.get(constraint_key(p)) for p in params_list]
            if any(f.done() if f is not None else not self._deferred for f in futs):
                return  # one is ready to submit
            # held for an engine step: behind a gate, or not listed yet by a deferred pass
            stalled = bool(self._gates) and all(f is None or id(f) in self._held for f in futs)
        if stalled:
            self._open_gates()
            return
        running = [f for f in futs if f is not None]
        if running:
            wait(running, timeout=timeout, return_when=FIRST_COMPLETED)  # (held ones wait out their wait_s timer)
        else:
            time.sleep(timeout)  # only requests a deferred pass may list: it starts on its wait_s timer

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> str:
        """Submit one request with a fresh id; raises the engine's InvalidRequestError/GrammarError."""
        rid = f"lang-{next(_ids)}"
        self.engine.add_request(list(prompt_ids), params, request_id=rid)
        return rid

    def pin_prefix(self, prompt_ids: list[int]) -> Any:
        """Protect a prefilled prefix in the engine's prefix cache (engines with `pin_prefix`); a
        handle for unpin_prefix, or None."""
        fn = getattr(self.engine, "pin_prefix", None)
        return fn(list(prompt_ids)) if fn is not None else None

    def unpin_prefix(self, handle: Any) -> None:
        fn = getattr(self.engine, "unpin_prefix", None)
        if handle is not None and fn is not None:
            fn(handle)

    def step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        finally:
            if self._gates:
                self._open_gates()

    def abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # already finished or unknown: nothing left to abort
            pass

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished())


def _settle(proxy: Future, fut: Future | None) -> None:
    """Resolve a precompile_after proxy like the engine's compile it stands for (its error too)."""
    err = fut.exception() if fut is not None and not fut.cancelled() else None
    if err is not None:
        proxy.set_exception(err)
    else:
        proxy.set_result(None)


_default_engine: Any = None
_default_lock = threading.Lock()


def set_default_backend(engine: Any) -> None:
    """Make `engine` the one programs run on when run/run_batch/arun get no `backend=`."""
    global _default_engine
    with _default_lock:
        _default_engine = engine


def get_default_backend() -> Any:
    """The default engine; the first call without one set builds `deepinfer.Engine()`."""
    global _default_engine
    with _default_lock:
        if _default_engine is None:
            from deepinfer.engine.engine import Engine  # lazily: importing the engine loads torch

            _default_engine = Engine()
        return _default_engine
