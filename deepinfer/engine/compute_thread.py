"""The one thread that runs every CPU engine's kernels: model loading, forward passes, sampling.

Why one: the native kernels and torch's CPU ops parallelise with OpenMP (libgomp), which keeps a team
of worker threads for each thread that starts a parallel region. Once two threads have started one
(an engine loaded in the main thread, then stepped by deepinfer.lang's runtime thread; or stepped
from both), libgomp manages more threads than there are CPUs and cuts the spin at each barrier from
~300,000 iterations to 100, so each of the few hundred parallel regions of a step sleeps and wakes on
a futex instead. Measured on the 2-core Zen 5 host (SmolLM2-135M Q4_1 under auto, 64 new tokens,
best of 3): engine.generate in the main thread after one `run_batch` gave 54 / 228 / 307 tok/s at
batch 1 / 8 / 32, against 128 / 378 / 453 with the engine's work on this thread; a 12-token prompt's
first step took 36-43 ms against 24-27. The thread is shared by the process's engines (their steps
are serialised, as they would be on the same cores anyway) and handed one call at a time: a handoff
costs ~96 us there (1-2% of a batch-1 step), paid per step rather than per `generate`, so that an
interrupted caller leaves at most one step running behind it.

Only CPU engines without expert parallelism use it (Engine): a CUDA engine's kernels are not
OpenMP's, and an expert-parallel rank keeps torch.distributed on the thread that set it up.

The cost comes back where the process runs torch work of its own on another thread (a transformers
model beside the engine: benchmarks/moe.py's DeepSeek-V3 model ran 36.9 tok/s at batch 1 so, 86.5 with
transformers on this thread too): such work belongs here as well, `compute_thread().run(fn)`.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

_lock = threading.Lock()
_thread: "ComputeThread | None" = None


class ComputeThread:
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="deepinfer-compute", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on this thread, in a copy of the caller's context (its context
        variables: deepinfer_kernels.use_backend), waited for; its exception re-raised here. From
        this thread itself (fn calling back into an engine) it is a plain call."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: Future = Future()
        self._calls.put((fut, contextvars.copy_context().run, (fn, *args), kwargs))
        return fut.result()

    def _serve(self) -> None:
        while True:
            fut, fn, args, kwargs = self._calls.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # (KeyboardInterrupt too: the caller gets it, the thread goes on)
                fut.set_exception(e)
            del fut, fn, args, kwargs  # hold nothing of the call (an engine) between calls


def compute_thread() -> ComputeThread:
    """The process's compute thread, started on first use."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = ComputeThread()
        return _thread


def _forget_in_child() -> None:  # a forked child has no such thread: it starts its own when needed
    global _thread, _lock
    _thread, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
