"""The overlapped loop's forward on CUDA: queued on the stream, waited on through an event.

On CUDA the forward pass only enqueues kernels (one graph replay for a captured decode step), so
no worker thread is needed: `StreamForward.launch` queues step N and returns at once, the engine
plans step N+1 and fills grammar masks on this thread, then `result()` on the returned future
waits on N's completion event. (The worker thread it replaces serialised on the GIL with the
planning it was meant to overlap: 0.6-0.9x of the synchronous loop on an H200, README.)

Forward times are read from CUDA events and mapped onto time.perf_counter's timeline, so the
stats' idle gap is the device's: the time between one forward's last kernel and the next's first.
"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """Maps CUDA event timestamps onto the host's perf_counter timeline (one reference point)."""

    def __init__(self, device: torch.device):
        torch.cuda.synchronize(device)
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record()
        self.ref.synchronize()
        self.host = time.perf_counter()

    def to_host(self, ev: "torch.cuda.Event") -> float:
        return self.host + self.ref.elapsed_time(ev) / 1e3


class EventFuture:
    """What the engine's overlapped loop waits on (the thread pool's Future interface: result())."""

    def __init__(self, start, end, clock: DeviceClock, stats):
        self.start, self.end, self.clock, self.stats = start, end, clock, stats
        self.done = False

    def result(self) -> None:
        self.end.synchronize()
        if not self.done:
            self.done = True
            self.stats.record_forward(self.clock.to_host(self.start), self.clock.to_host(self.end))


class StreamForward:
    def __init__(self, runner, stats, device: torch.device):
        self.runner = runner
        self.stats = stats
        self.clock = DeviceClock(device)

    def launch(self, st, prepared, prev_tokens) -> EventFuture:
        """Queue st's forward pass on the current stream; st.logits is valid once result() returns."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        st.logits = self.runner.forward(prepared, prev_tokens)
        end.record()
        return EventFuture(start, end, self.clock, self.stats)
