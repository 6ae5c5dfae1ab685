"""Raw engine requests as futures: one thread owns the engine, adds what callers submit and steps
it while anything is unfinished (the engine is not thread-safe, so nothing else may touch it
while a driver runs). `run-batch` uses it to keep a window of OpenAI requests in flight through
the same `window.run_window` the program jobs use.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams


class _Group:
    """The requests of one submit (n choices x prompts); its future gets their outputs in order."""

    def __init__(self, requests: list[tuple[Any, SamplingParams]], future: Future) -> None:
        self.requests, self.future = requests, future
        self.rids: list[str] = []
        self.outs: dict[str, RequestOutput] = {}


class EngineDriver:
    """`submit(requests)` -> Future of [RequestOutput] (one per (prompt, params), in order)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._q: queue.SimpleQueue[_Group | None] = queue.SimpleQueue()
        self._groups: dict[str, _Group] = {}
        self._closed = self._abort = False
        self._thread = threading.Thread(target=self._loop, name="deepinfer-engine-driver", daemon=True)
        self._thread.start()

    def submit(self, requests: list[tuple[Any, SamplingParams]]) -> Future:
        if self._closed:
            raise RuntimeError("the engine driver is closed")
        fut: Future = Future()
        self._q.put(_Group(list(requests), fut))
        return fut

    def close(self, abort: bool = False) -> None:
        """Stop the thread once what is in flight has finished (with `abort`: abort it now)."""
        if not self._closed:
            self._closed = True
            self._abort = abort
            self._q.put(None)
            self._thread.join()

    def __enter__(self) -> "EngineDriver":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(abort=exc_type is not None)  # e.g. Ctrl-C: do not finish the window first

    # ------------------------------------------------------------------ driver thread
    def _admit(self, group: _Group) -> None:
        try:
            for prompt, params in group.requests:
                group.rids.append(self.engine.add_request(prompt, params))
        except Exception as e:  # a typed admission error: this group only
            for rid in group.rids:
                self.engine.abort(rid)
            group.future.set_exception(e)
            return
        for rid in group.rids:
            self._groups[rid] = group

    def _fail_all(self, exc: BaseException) -> None:
        for group in {id(g): g for g in self._groups.values()}.values():
            if not group.future.done():
                group.future.set_exception(exc)
        for rid in list(self._groups):
            try:
                self.engine.abort(rid)
            except Exception:
                pass
        self._groups.clear()

    def _flush(self) -> None:
        """Step until the engine has reported every abort, so whoever uses it next finds it idle."""
        for _ in range(10_000):
            if not self.engine.has_unfinished():
                return
            try:
                self.engine.step()
            except Exception:  # a broken engine: nothing more to do for it here
                return

    def _loop(self) -> None:
        stopping = False
        while True:
            idle = not self._groups
            if stopping and idle:
                return
            try:
                # block only when nothing is running; otherwise take what is queued and step
                item = self._q.get(block=idle)
                while True:
                    if item is None:
                        stopping = True
                    else:
                        self._admit(item)
                    item = self._q.get_nowait()
            except queue.Empty:
                pass
            if stopping and self._abort:
                self._fail_all(RuntimeError("the engine driver was closed"))
                self._flush()
                return
            if not self._groups:
                continue
            if not self.engine.has_unfinished():  # a bug, never a silent hang
                self._fail_all(RuntimeError("engine stopped with requests pending"))
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # the engine itself failed: fail what is in flight, keep serving
                self._fail_all(e)
                continue
            for out in outs:
                group = self._groups.get(out.request_id)
                if group is None or not out.finished:
                    continue
                del self._groups[out.request_id]
                group.outs[out.request_id] = out
                if len(group.outs) == len(group.rids):
                    group.future.set_result([group.outs[r] for r in group.rids])
