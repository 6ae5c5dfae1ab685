"""A model-runner stand-in whose step takes a set wall time T without using the engine's CPU time,
for measuring the engine's host work on this CPU as it would be beside a GPU
(benchmarks/host_overhead.py) and for tests. Never a production path: the engine does not import it
(simulated_engine.py plugs it in through two Engine hooks).

Interface: what the engine calls on its `ModelRunner` (`prepare`, `forward`, `num_blocks`,
`weight_bytes`, `copy_kv_tokens`, `measure_forward_cost`, `close`), plus `submit`, which returns at
once with a `DeviceResult` whose logits are valid only once `wait()` returns, no sooner than the step's
deadline (start + T), as on a CUDA stream; `SimulatedStream` gives the overlapped loop that
launch / result pair in the shape of cuda_overlap.StreamForward. Waiting is a sleep, then a blocking
read: the waiting thread uses no CPU and holds no GIL.

Logits, not token ids: today the engine samples on the host from the forward's logits (StepSampler:
grammar masks, min-token bans, penalties, argmax / inverse-CDF draws), so returning logits keeps that
real host path running. Each row is one of `pool_rows` seeded N(0, 1) rows, picked by a hash of the
row's whole token context (device_worker.Fingerprints: one 64-bit rolling hash per KV slot, the
device's "KV cache"); the engine's real mask then leaves only the tokens the row's grammar allows and
its real sampler draws among them (greedy: the argmax of i.i.d. values over the allowed set, a uniform
seeded draw from it; an unconstrained greedy row draws from the pool rows' argmaxes). A row depends only
on its sequence's tokens, never on the batch's layout or block ids, so the synchronous and overlapped
loops (whose batches can differ) draw the same tokens, and a prefix-cache hit, a fork or a recompute
after preemption sees what a recompute would.

Why a process: the sampler modifies its logits in place (masks, bans, penalties), so each step needs
fresh rows, R x V fp32: 12.6 MB at batch 64, 50 MB at 256 with SmolLM2's 49152 tokens. Writing them
(one memcpy a row from the pool) took 0.7 / 2.2 / 6-7 ms at batch 64 / 256 / 1024 on this 2-core host:
on the engine's thread that is host time no GPU engine pays. A thread would release the GIL inside the
copy, but needs it to start and finish: with the engine's thread busy in Python, a device thread picked
its job up 5-16 ms after submission (the interpreter's 5 ms switch interval), so steps would end late
for a reason no device has. The worker process (device_worker.py) writes the rows into shared memory
on the other core while T runs; a step is done on the modelled device max(T, the write's duration)
after its start (the interval the engine's stats record; from about batch 1024 the write exceeds
T = 5 ms here), and the engine's wait returns once the rows are really there; where the process found
no free core (it runs at idle priority, device_worker.yield_to_the_host) that is later: `late_time`,
which benchmarks report beside the device's time.
The host's share of the stand-in is `prepare` (each sequence's previous KV slot looked up in its block
table, the request bytes; numpy, ~0.1 ms at batch 256) and one pipe write per step, about what a real
runner's prepare and launch cost.
"""

from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.errors import DeepInferError
from deepinfer.testing import device_worker as W

RING = 3  # logits buffers reused in turn (why that is safe: SimulatedDevice.submit)
MIN_ROWS = 64  # smallest buffer, in rows (buffers grow to the next power of two a step needs)
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None  # memory-backed files where there are


class SimulatedDeviceError(DeepInferError):
    """The simulated device was driven as no real runner would be (a feature it does not simulate, a
    placeholder input id without the previous step's tokens), or its process ended."""


@dataclass
class PreparedStep:
    """A batch laid out for the device: the request bytes, but for the previous step's tokens."""

    batch: ForwardBatch
    payload: bytes  # ids, positions, slots, query lens, previous slots, logit rows (int64)
    num_tokens: int
    num_seqs: int
    num_rows: int


class DeviceResult:
    """One step in flight: `logits` ([R, V]) is valid once `wait()` returns."""

    def __init__(self, device: "SimulatedDevice", job: int, logits: torch.Tensor, start: float, deadline: float):
        self._device = device
        self.job = job
        self.logits = logits
        self.start = start  # when the device began the step (perf_counter)
        self.deadline = deadline  # start + T
        self.written = 0.0  # when the device process had written the rows (set once reported)
        self.write_s = 0.0  # how long the process took to write them

    def done(self) -> bool:
        if self.written:  # waited for already
            return True
        return self._device._reported(self.job, block=False) and time.perf_counter() >= self.deadline

    @property
    def end(self) -> float:
        """When the step was complete on the modelled device: T after its start, or the rows' write time
        after it if longer. (The rows may really be there later, when the process found no free core:
        `late`; the engine waits for them either way.)"""
        return self.start + max(self.deadline - self.start, self.write_s)

    @property
    def late(self) -> float:
        return max(0.0, self.written - self.end)

    def wait(self) -> torch.Tensor:
        """Sleep until the deadline, then until the device reports the rows written; the logits."""
        if self.written:
            return self.logits
        while (left := self.deadline - time.perf_counter()) > 0:
            time.sleep(left)
        self._device._reported(self.job, block=True)
        began, self.written = self._device._written.pop(self.job)
        self.write_s = self.written - began
        self._device.late_time += self.late
        return self.logits


class SimulatedDevice:
    """The runner stand-in (see the module docstring). step_s: every step's wall time T (settable
    between steps); num_blocks: the KV pool the engine's bookkeeping manages; block_size: its blocks'."""

    precision = "simulated"
    num_mtp_layers = 0

    def __init__(self, vocab_size: int, step_s: float, num_blocks: int, block_size: int, seed: int = 0,
                 pool_rows: int = 64, rows_hint: int = MIN_ROWS):
        if step_s < 0:
            raise SimulatedDeviceError(f"step time must be >= 0 seconds, got {step_s}")
        if min(vocab_size, num_blocks, block_size, pool_rows) < 1:
            raise SimulatedDeviceError("vocab_size, num_blocks, block_size and pool_rows must be positive")
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seed = seed
        self.steps = 0
        self.write_time = 0.0  # seconds the device's process spent on steps (fingerprints + logits rows)
        self.late_time = 0.0  # seconds steps' rows were there after their modelled end (DeviceResult.late)
        self._ring: list[np.ndarray | None] = [None] * RING
        self._turn = 0
        self._jobs = 0
        self._busy_until = 0.0  # the device runs one step at a time
        self._written: dict[int, tuple[float, float]] = {}  # job -> its write's (start, end), not yet waited
        self._paths: list[str] = []  # buffer files the process has not attached (and unlinked) yet
        self._proc = subprocess.Popen(
            [sys.executable, W.__file__, str(vocab_size), str(num_blocks * block_size), str(seed), str(pool_rows)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._w, self._r = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        self._close = weakref.finalize(self, _shutdown, self._proc, self._paths)
        # every buffer at its likely size now (rows_hint: the engine's max_num_seqs), not in the first steps
        # that need it: a buffer's first write took 33 ms for 256 rows (tmpfs pages allocated on touch)
        # against 2.1 ms after; MAP_POPULATE allocates them as they are mapped
        for k in range(RING):
            self._ring[k] = self._attach(k, self._rows(rows_hint))

    # ---- the step -------------------------------------------------------------------------------
    def submit(self, prepared: "PreparedStep | ForwardBatch", prev_tokens: torch.Tensor | None = None) -> DeviceResult:
        """Start a step; returns at once. Its logits ([len(logit_rows), V]) are valid after wait().

        The logits buffers are reused every RING steps: the engine reads a step's logits only between
        its wait and the launch of the step after it (both loops sample step N before launching N + 1),
        so when a buffer comes round again, the step that used it was sampled two launches ago."""
        if isinstance(prepared, ForwardBatch):
            prepared = self.prepare(prepared)
        R = prepared.num_rows
        k = self._turn = (self._turn + 1) % RING
        buf = self._ring[k]
        if buf is None or buf.shape[0] < R:
            buf = self._ring[k] = self._attach(k, self._rows(R))
        prev = b""
        if prev_tokens is not None and prev_tokens.numel():
            prev = prev_tokens.to(torch.long).numpy().tobytes()
        self._jobs += 1
        job = self._jobs
        self._send(struct.pack("<8q", W.STEP, job, k, prepared.num_tokens, prepared.num_seqs, R, len(prev) // 8, 0)
                   + prepared.payload + prev)
        start = max(time.perf_counter(), self._busy_until)
        res = DeviceResult(self, job, torch.from_numpy(buf[:R]), start, start + self.step_s)
        self._busy_until = res.deadline
        self.steps += 1
        return res

    @staticmethod
    def _rows(n: int) -> int:
        return max(MIN_ROWS, 1 << max(n - 1, 0).bit_length())

    def _attach(self, k: int, rows: int) -> np.ndarray:
        """A shared buffer of `rows` logits rows, mapped here and (by its next request) in the process."""
        fd, path = tempfile.mkstemp(prefix="deepinfer-simdev-", dir=SHM_DIR)
        try:
            os.ftruncate(fd, rows * self.vocab_size * 4)
            mm = W.map_shared(fd, rows * self.vocab_size * 4)
        finally:
            os.close(fd)
        self._paths.append(path)  # the process unlinks it once mapped; close() unlinks any it never saw
        enc = path.encode()
        self._send(struct.pack("<8q", W.ATTACH, 0, k, rows, len(enc), 0, 0, 0) + enc)
        return np.frombuffer(mm, dtype=np.float32).reshape(rows, self.vocab_size)

    def _send(self, data: bytes) -> None:
        try:
            W._write_all(self._w, data)
        except OSError as e:
            raise SimulatedDeviceError(f"the simulated device process ended ({e})") from None

    def _reported(self, job: int, block: bool) -> bool:
        """Whether the process has reported `job` (reading every report that is waiting; with block,
        until job's arrives)."""
        while job not in self._written:
            if not block and not select.select([self._r], [], [], 0)[0]:
                return False
            try:
                done, began, ended = W.REPLY.unpack(self._read(W.REPLY.size))
            except EOFError:
                raise SimulatedDeviceError(f"the simulated device process ended (exit code {self._proc.poll()})") from None
            if began < 0:
                (n,) = struct.unpack("<q", self._read(8))
                raise SimulatedDeviceError(f"simulated device step {done} failed: {self._read(n).decode()}")
            self._written[done] = (began, ended)
            self.write_time += ended - began
        return True

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = os.read(self._r, n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out

    # ---- ModelRunner's interface ----------------------------------------------------------------
    def prepare(self, batch: ForwardBatch, mtp_depth: int | None = None) -> PreparedStep:
        """The request bytes of a batch: its tokens, positions and slots, each sequence's query length
        and the KV slot of the token before its first (where its context's fingerprint is), its rows."""
        if mtp_depth is not None:
            raise SimulatedDeviceError("the simulated device has no MTP layers")
        bs = batch.block_size
        ql = batch.query_lens.numpy()
        starts = batch.context_lens.numpy() - ql
        before = np.maximum(starts - 1, 0)
        prev_slot = batch.block_tables.numpy()[np.arange(ql.size), before // bs] * bs + before % bs
        prev_slot[starts == 0] = -1
        payload = b"".join((batch.input_ids.numpy().tobytes(), batch.positions.numpy().tobytes(),
                            batch.slot_mapping.numpy().tobytes(), ql.tobytes(), prev_slot.tobytes(),
                            batch.logit_rows.numpy().tobytes()))
        return PreparedStep(batch, payload, batch.num_tokens, int(ql.size), int(batch.logit_rows.numel()))

    def forward(self, batch: "PreparedStep | ForwardBatch", prev_tokens: torch.Tensor | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        """The synchronous loop's call: the step's logits once it is done (T later)."""
        if num_layers is not None:
            raise SimulatedDeviceError("the simulated device runs no early exit (speculative='draft')")
        return self.submit(batch, prev_tokens).wait()

    def forward_with_hidden(self, batch, prev_tokens=None):
        raise SimulatedDeviceError("the simulated device keeps no hidden states (speculative='mtp')")

    def measure_forward_cost(self, sizes: list[int], repeats: int = 1,
                             num_layers: int | None = None) -> list[tuple[int, float]]:
        """The verification cost model's points: every step takes T, whatever its size."""
        return [(n, self.step_s) for n in sizes]

    def copy_kv_tokens(self, src_block: int, dst_block: int, n: int) -> None:
        """fork: the first n slots' fingerprints of one block copied to another (in order with the steps)."""
        bs = self.block_size
        self._send(struct.pack("<8q", W.COPY, 0, 0, src_block * bs, dst_block * bs, n, 0, 0))

    def weight_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Stop the device's process (Engine.close calls this); idempotent."""
        self._close()


def _shutdown(proc: subprocess.Popen, paths: list[str]) -> None:
    try:
        W._write_all(proc.stdin.fileno(), struct.pack("<8q", W.STOP, 0, 0, 0, 0, 0, 0, 0))
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        proc.kill()
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    if proc.stdout is not None:
        proc.stdout.close()


class _StepFuture:
    """The overlapped loop's handle on a step (the thread pool Future's `result()`)."""

    def __init__(self, res: DeviceResult, stats):
        self.res = res
        self.stats = stats
        self.recorded = False

    def done(self) -> bool:
        return self.res.done()

    def result(self) -> None:
        if not self.recorded:  # the device's own interval, as cuda_overlap.EventFuture records it
            self.res.wait()
            self.recorded = True
            self.stats.record_forward(self.res.start, self.res.end)


class SimulatedStream:
    """cuda_overlap.StreamForward's interface over the simulated device: `launch` queues a step and
    returns at once; the engine plans the next step and post-processes the last meanwhile."""

    def __init__(self, device: SimulatedDevice, stats):
        self.device = device
        self.stats = stats

    def launch(self, st, prepared: PreparedStep, prev_tokens: torch.Tensor | None) -> _StepFuture:
        res = self.device.submit(prepared, prev_tokens)
        st.logits = res.logits  # valid once the future's result() returns
        return _StepFuture(res, self.stats)
