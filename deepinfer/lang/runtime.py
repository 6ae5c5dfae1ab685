"""The program runtime: many programs, one engine, one thread.

Each program runs in its own greenlet inside one runtime thread per engine. A program runs until
it must wait for a result (it reads a variable, forks, joins or ends while requests are out),
then switches back to the scheduler loop, which

  1. admits new programs while each batch has fewer than its window in flight,
  2. resumes every ready program until it waits again or ends,
  3. releases the static-prefix gate of batches that asked for prefix sharing,
  4. submits every pending request to the engine (keeping its continuous batch full),
  5. steps the engine and routes each incremental output to its op; finished ops update their
     state, and programs whose awaited states became idle are ready again.

run/run_batch/arun from any thread (or event loop) hand batches to this thread; results come
back through concurrent futures (wrapped for asyncio by `arun`). Threads stay at one per engine,
memory at the window of live greenlets, however many programs a batch holds.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import greenlet

from deepinfer.errors import ProgramError
from deepinfer.lang.backend import EngineBackend
from deepinfer.lang.ops import Event, Op, PrefixDone, PrefixOp
from deepinfer.lang.state import ProgramState, render_prompt


@dataclass
class RuntimeStats:
    """Counters for tests and benchmarks."""

    programs: int = 0
    max_active_programs: int = 0
    requests: int = 0
    prefix_requests: int = 0
    steps: int = 0
    max_outstanding_requests: int = 0


class Program:
    """One program invocation: its function, arguments, states and greenlet."""

    def __init__(self, runtime: "Runtime", batch: "Batch", index: int, args: tuple, kwargs: dict) -> None:
        self.runtime, self.batch, self.index = runtime, batch, index
        self.backend = runtime.backend
        self.func, self.args, self.kwargs = batch.func, args, kwargs
        self.defaults, self.stream = batch.defaults, batch.stream
        self.cv = threading.Condition()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.greenlet: greenlet.greenlet | None = None
        self.waiting: list[Any] | None = None
        self.states: list[Any] = []
        self.state = ProgramState(self)

    def body(self) -> None:
        try:
            self.func(self.state, *self.args, **self.kwargs)
            # the program returned: finish what it left in flight (forks included); a fork's
            # failure surfaces where the program reads that fork, the root's failure here
            self.runtime.wait(self, list(self.states))
            if self.state.failure is not None:
                raise self.state.failure
        except Exception as e:  # captured per program, never aborts the batch
            self.error = e


class Batch:
    """Programs submitted together: the window bounds how many are live at once."""

    def __init__(self, func: Callable, jobs: list[tuple[tuple, dict]], defaults: dict, window: int,
                 share_prefix: bool, stream: bool, prefix: list | None = None, first_alone: bool = False) -> None:
        self.func, self.jobs, self.defaults = func, jobs, defaults
        self.window, self.stream = max(1, int(window)), stream
        # the compiler's plan: run only the first program until the engine's next step returns (the
        # others' requests would wait for their constraints anyway, which compile after that step;
        # running them first put 100 programs' frontend work before the batch's first output)
        self.first_alone = first_alone
        self.n = len(jobs)
        self.next = 0
        self.active = 0
        self.finished = 0
        self.programs: list[Program | None] = [None] * self.n
        self.futures: list[Future] = [Future() for _ in range(self.n)]
        # prefix sharing: a planned prefix (from the compiler) is prefilled at once; without one
        # the first wave's first requests are collected and their common prefix prefilled
        self.planned_prefix = prefix if prefix and self.n > 1 else None
        if self.planned_prefix is not None:
            self.gate = "plan"
        else:
            self.gate = "collect" if share_prefix and self.n > 1 else "open"
        if self.first_alone and self.gate == "collect":
            # collecting the first wave's requests for their common prefix needs the whole wave; the
            # compiler's plan found no shared prefix in these programs' text (batch_prefix covers the
            # static text and the common start of the varying arguments), so none is collected
            self.gate = "open"
        self.held: list[tuple] = []
        self.prefix_ids: list[int] | None = None
        self.pin: Any = None  # the engine's pin of the planned prefix, released when the batch ends


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    first = min(seqs, key=len)
    n = len(first)
    for s in seqs:
        i = 0
        while i < n and s[i] == first[i]:
            i += 1
        n = i
        if n == 0:
            break
    return first[:n]


class Runtime:
    """Scheduler for all programs on one engine (see the module docstring)."""

    def __init__(self, engine: Any, min_shared_prefix: int = 8) -> None:
        self.backend = EngineBackend(engine)
        self.min_shared_prefix = min_shared_prefix
        self.stats = RuntimeStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._incoming: list[Batch] = []
        self._batches: list[Batch] = []
        self._ready: deque[Program] = deque()
        self._to_submit: list[tuple] = []
        self._parked: list[tuple] = []  # requests whose constraint is still being precompiled
        # request id -> the compile still running when it was submitted (see _submit)
        self._early: dict[str, Future] = {}
        self._reqs: dict[str, tuple[Op, Any]] = {}
        self._thread: threading.Thread | None = None
        self._glet: greenlet.greenlet | None = None

    # ------------------------------------------------------------------ entry (any thread)
    def submit(self, func: Callable, jobs: list[tuple[tuple, dict]], defaults: dict, *, window: int = 256,
               share_prefix: bool = False, stream: bool = False, prefix: list | None = None,
               first_alone: bool = False) -> Batch:
        """Queue a batch of program invocations; returns at once (see Batch.futures).

        `prefix`: the compiler's prefix plan (lists of leaves: the static text and first prompts);
        their common tokens are prefilled once before the batch's requests go in."""
        if self.in_loop_thread():
            raise ProgramError(
                "run/run_batch/arun cannot be called inside a running program; call the other "
                "function directly instead: other(s, ...)"
            )
        batch = Batch(func, jobs, defaults, window, share_prefix, stream, prefix, first_alone)
        _gc_batch(+1)
        if stream:  # the caller needs the state object now, to iterate its text
            for i in range(batch.n):
                batch.programs[i] = Program(self, batch, i, *jobs[i])
        with self._lock:
            self._incoming.append(batch)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._main, name="deepinfer-lang", daemon=True)
                self._thread.start()
            self._wake.notify()
        return batch

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    # ------------------------------------------------------------------ called by states / ops
    def enqueue(self, op: Op) -> None:
        """Queue an op's requests for the next submission round."""
        batch = op.owner.program.batch
        for tag, prompt, params in op.requests():
            self._to_submit.append((op, tag, prompt, params, batch))

    def wait(self, prog: Program, states: list[Any]) -> None:
        """Suspend `prog` (from its own greenlet) until every state in `states` is idle."""
        while not all(st.idle() for st in states):
            prog.waiting = states
            self._glet.switch()
        prog.waiting = None

    def state_idle(self, state: Any) -> None:
        """A state finished its queue: wake its program if that is all it waited for."""
        prog = state.program
        if prog.waiting is not None and all(st.idle() for st in prog.waiting):
            prog.waiting = None
            self._ready.append(prog)

    def deliver(self, event: Event) -> None:
        """The runtime owns only the shared-prefix ops (PrefixOp): one is prefilled."""
        if isinstance(event, PrefixDone):
            self.prefix_done(event.op.batch)

    def op_failed(self, op: Op, exc: BaseException) -> None:
        # sharing is an optimisation: on failure just let the programs' own requests through
        self.open_gate(op.batch)

    def prefix_done(self, batch: Batch) -> None:
        """The batch's shared prefix is prefilled: pin a planned one for the batch's lifetime, open the gate."""
        if batch.planned_prefix is not None and batch.prefix_ids and batch.finished < batch.n:
            try:
                batch.pin = self.backend.pin_prefix(batch.prefix_ids)
            except Exception:  # pinning is an optimisation
                batch.pin = None
        self.open_gate(batch)

    def open_gate(self, batch: Batch) -> None:
        """Let a batch's held requests through (its shared prefix is cached, or sharing is off)."""
        if batch.gate != "open":
            batch.gate = "open"
            self._to_submit.extend(batch.held)
            batch.held = []

    # ------------------------------------------------------------------ the loop
    def _main(self) -> None:
        self._glet = greenlet.getcurrent()
        try:
            self._loop()
        except BaseException as e:  # a runtime bug: fail every caller rather than hang them
            err = ProgramError(f"the program runtime crashed: {type(e).__name__}: {e}")
            for b in self._batches + self._incoming:
                if b.finished < b.n:
                    _gc_batch(-1)
                for f in b.futures:
                    if not f.done():
                        f.set_exception(err)
            raise

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._batches.extend(self._incoming)
                self._incoming.clear()
                if not self._batches:
                    self._wake.wait()
                    continue
            self._admit()
            self._run_ready()
            self._submit()  # gated batches' requests land in their `held` list here
            self._release_gates()
            if self._ready or self._to_submit:
                continue
            if self._reqs:
                self._step()
            elif self._parked:  # only requests waiting on their compile: wait for one to finish
                self.backend.wait_compiles(0.05, [e[3] for e in self._parked])
            elif any(b.active for b in self._batches):
                self._fail_stuck()
            self._batches = [b for b in self._batches if b.finished < b.n]

    def _admit(self) -> None:
        for b in self._batches:
            if b.gate == "plan":
                self._start_planned_prefix(b)
            while b.active < (1 if b.first_alone else b.window) and b.next < b.n:
                i = b.next
                b.next += 1
                b.active += 1
                prog = b.programs[i] or Program(self, b, i, *b.jobs[i])
                b.programs[i] = prog
                b.jobs[i] = None  # the arguments now live in the program
                prog.greenlet = greenlet.greenlet(prog.body, parent=self._glet)
                self._ready.append(prog)
                self.stats.programs += 1
        active = sum(b.active for b in self._batches)
        self.stats.max_active_programs = max(self.stats.max_active_programs, active)

    def _run_ready(self) -> None:
        while self._ready:
            prog = self._ready.popleft()
            prog.greenlet.switch()
            if prog.greenlet.dead:
                self._finish(prog)

    def _finish(self, prog: Program) -> None:
        for st in prog.states:  # an error ended the program: drop what it left in flight
            op = st.abandon()
            if op is not None:
                self._cancel(op)
        prog.greenlet = None
        b = prog.batch
        b.active -= 1
        b.finished += 1
        b.programs[prog.index] = None  # the state keeps what the caller needs
        if b.finished == b.n:
            _gc_batch(-1)
            if b.pin is not None:
                self.backend.unpin_prefix(b.pin)
                b.pin = None
        with prog.cv:
            prog.done.set()
            prog.cv.notify_all()
        b.futures[prog.index].set_result(prog.state)

    def _release_gates(self) -> None:
        """Prefix sharing: once a batch's first wave waits on its first requests, submit their
        longest common token prefix once (prefill only) and hold the rest until it is cached."""
        for b in self._batches:
            if b.gate != "collect" or b.next < min(b.window, b.n):
                continue
            prompts = [e[2] for e in b.held if not e[0].cancelled]
            lcp = _common_prefix(prompts) if len(prompts) >= 2 else []
            if len(lcp) < self.min_shared_prefix:
                self.open_gate(b)
                continue
            b.gate = "prefix"
            b.prefix_ids = lcp
            op = PrefixOp(self, b, lcp)
            self.stats.prefix_requests += 1
            for tag, prompt, params in op.requests():
                self._add((op, tag, prompt, params, b))

    def _start_planned_prefix(self, b: Batch) -> None:
        """The compiler's static prefix: prefill it once now, holding the batch's requests till then."""
        try:  # the static text and two programs' first prompts: their common tokens
            ids = _common_prefix([render_prompt(self.backend, leaves) for leaves in b.planned_prefix])
        except Exception:  # e.g. a role the template lacks: every program reports it; no sharing
            ids = []
        if len(ids) < self.min_shared_prefix:
            self.open_gate(b)
            return
        b.gate = "prefix"
        b.prefix_ids = ids
        op = PrefixOp(self, b, ids)
        self.stats.prefix_requests += 1
        for tag, prompt, params in op.requests():
            self._add((op, tag, prompt, params, b))

    def _submit(self) -> None:
        entries, self._to_submit = self._parked + self._to_submit, []
        self._parked = []
        for e in entries:
            if e[0].cancelled:
                continue
            if e[4].gate != "open":
                e[4].held.append(e)
                continue
            if self.backend.compiling(e[3]):
                # nothing in flight and an engine that prefills while compiling: submit it now, so
                # its prefill runs beside the compile instead of after it (the compiled batch's first
                # request, whose schema compiles alone: Engine.add_request says what that saves);
                # otherwise keep stepping the others and submit it once compiled
                running = None if self._reqs else self.backend.compile_in_flight(e[3])
                if running is None:
                    self._parked.append(e)
                    continue
                self._add(e, running)
                continue
            self._add(e)

    def _add(self, entry: tuple, compiling: Future | None = None) -> None:
        op, tag, prompt, params, _ = entry
        if op.cancelled:
            return
        try:
            rid = self.backend.add_request(prompt, params)
        except Exception as exc:  # InvalidRequestError / GrammarError: belongs to this program
            self._fail_op(op, exc)
            return
        if compiling is not None:
            self._early[rid] = compiling
        op.rids.append(rid)
        self._reqs[rid] = (op, tag)
        self.stats.requests += 1
        self.stats.max_outstanding_requests = max(self.stats.max_outstanding_requests, len(self._reqs))

    def _cancel(self, op: Op) -> None:
        op.cancelled = True
        for rid in op.rids:
            self._early.pop(rid, None)
            if self._reqs.pop(rid, None) is not None:
                self.backend.abort(rid)

    def _fail_op(self, op: Op, exc: BaseException) -> None:
        if op.cancelled:
            return
        self._cancel(op)
        op.owner.op_failed(op, exc)

    def _step(self) -> None:
        self.stats.steps += 1
        try:
            outs = self.backend.step()
        except Exception as exc:  # the engine failed: every request in flight fails with it
            err = ProgramError(f"engine step failed: {type(exc).__name__}: {exc}")
            for op in {id(op): op for op, _ in self._reqs.values()}.values():
                self._fail_op(op, err)
            return
        finally:
            for b in self._batches:
                b.first_alone = False
        for out in outs:
            entry = self._reqs.get(out.request_id)
            if entry is None:
                continue  # aborted or foreign request
            if out.finished:
                del self._reqs[out.request_id]
            op, tag = entry
            if op.cancelled:
                continue
            if self._early and out.request_id in self._early:
                compiled = self._early.pop(out.request_id)
                err = compiled.exception() if out.finish_reason == "error" and compiled.done() else None
                if err is not None:  # the compile failed: the error its submission would have raised
                    self._fail_op(op, err)
                    continue
            try:
                for event in op.on_output(tag, out):
                    op.owner.deliver(event)
            except Exception as exc:
                self._fail_op(op, exc)
        if not outs and self._reqs and not self.backend.has_unfinished():
            err = ProgramError("the engine has no unfinished requests but programs still wait on some")
            for op in {id(op): op for op, _ in self._reqs.values()}.values():
                self._fail_op(op, err)

    def _fail_stuck(self) -> None:
        """Programs wait but nothing is in flight: a runtime bug; fail them instead of hanging."""
        for b in self._batches:
            for prog in b.programs:
                if prog is not None and prog.waiting is not None:
                    for st in list(prog.waiting):
                        if not st.idle():
                            st.abandon()
                            st.fail(ProgramError("internal: waited on a state with nothing in flight"))
                    if prog.waiting is not None:  # fail() above did not already wake it
                        prog.waiting = None
                        self._ready.append(prog)


_gc_lock = threading.Lock()
_gc_batches = 0  # batches running in any runtime of the process


def _gc_batch(delta: int) -> None:
    """While any batch runs, the objects that were alive when the first of them started (the engine,
    its model and tokenizer, imported modules) are out of the cyclic GC's reach (`gc.freeze`); when the
    last one ends they are handed back (`gc.unfreeze`), so nothing stays uncollectable after.

    A full collection comes once about 11 young collections have promoted enough survivors (a
    run_batch's states, ops and meta are such survivors) and scanned those long-lived objects for
    160-300 ms (the engine on a tiny model on this CPU: 176k tracked objects; in the alternating
    run_batch-vs-generate benchmark the DSL side paid one per 256 programs x 2 gens, 200-300 ms of GC
    against 30 ms for generate, until each run started from a fresh collection). Frozen, it scans
    only what the batches made. Freezing and unfreezing move whole lists: O(1).
    """
    global _gc_batches
    import gc

    with _gc_lock:
        before = _gc_batches
        _gc_batches = max(0, _gc_batches + delta)
        if before == 0 and _gc_batches > 0:
            gc.freeze()
        elif before > 0 and _gc_batches == 0:
            gc.unfreeze()


_runtimes: dict[int, tuple[Any, Runtime]] = {}
_runtimes_lock = threading.Lock()


def get_runtime(engine: Any) -> Runtime:
    """The (single) runtime of `engine`, created on first use."""
    with _runtimes_lock:
        hit = _runtimes.get(id(engine))
        if hit is None or hit[0] is not engine:
            hit = (engine, Runtime(engine))
            _runtimes[id(engine)] = hit
        return hit[1]
