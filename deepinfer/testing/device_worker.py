"""The simulated device's own process (simulated_device.py starts it by path: numpy and the standard
library only, so it starts in ~0.1 s and never imports torch or the engine).

It holds the device's state: a seeded pool of logits rows and one 64-bit fingerprint per KV slot (its
"KV cache": a rolling hash of the token context up to that position). For each step it writes every
token's fingerprint into its slot and every logits row the step returns, as the pool row its token's
fingerprint picks, into a buffer it shares with the engine's process; then it reports when it did.

The wire protocol, over its stdin / stdout (all integers int64 little-endian):
  request  = header (8 int64: op, job, buffer, a, b, c, d, 0) + payload
    ATTACH  buffer, a = rows, b = len(path)      payload: the path of a file of rows x vocab fp32 to map
    STEP    job, buffer, a = T tokens, b = B sequences, c = R logits rows, d = P previous tokens
            payload: ids[T], positions[T], slots[T], query_lens[B], prev_slot[B] (-1: starts at 0),
            logit_rows[R], prev_tokens[P] (placeholder id -(i + 1) is prev_tokens[i])
    COPY    a = source slot, b = destination slot, c = count (fork)
    STOP
  reply    = job (int64), began (float64), ended (float64) per STEP, in order (perf_counter: CLOCK_MONOTONIC,
             the same clock in both processes); began < 0: it failed, followed by len (int64) + message.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import time

import numpy as np

ATTACH, STEP, COPY, STOP = 1, 2, 3, 4
HEADER = struct.Struct("<8q")
REPLY = struct.Struct("<qdd")
ROOT = 0x9E3779B97F4A7C15  # the fingerprint before position 0 is ROOT mixed with the seed
MULT = 0x2545F4914F6CDD1D  # the rolling hash's multiplier (odd: invertible mod 2**64)
MULT_INV = pow(MULT, -1, 1 << 64)
_M64 = (1 << 64) - 1
U64 = np.uint64


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 values (numpy array arithmetic wraps mod 2**64)."""
    x = x ^ (x >> U64(30))
    x = x * U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> U64(27))
    x = x * U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


def token_hash(ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return mix(ids.astype(U64) * U64(0xD6E8FEB86659FD93) + positions.astype(U64))


class Fingerprints:
    """fp[p] = fp[p - 1] * MULT + token_hash(token p, p), fp[-1] = root: a hash of the context up to
    each position, computed for a whole step at once (prefill chunks included) and kept per KV slot."""

    def __init__(self, num_slots: int, seed: int):
        self.store = np.zeros(num_slots, dtype=U64)
        self.root = U64(int(mix(np.array([(ROOT ^ seed) & _M64], dtype=U64))[0]))
        self._pow = np.ones(1, dtype=U64)  # MULT ** t
        self._inv = np.ones(1, dtype=U64)  # MULT_INV ** t

    def _powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self._pow.size < n:
            k = max(n, 2 * self._pow.size)
            self._pow = np.concatenate([[U64(1)], np.cumprod(np.full(k - 1, MULT, dtype=U64))]).astype(U64)
            self._inv = np.concatenate([[U64(1)], np.cumprod(np.full(k - 1, MULT_INV, dtype=U64))]).astype(U64)
        return self._pow[:n], self._inv[:n]

    def step(self, ids, positions, slots, query_lens, prev_slot) -> np.ndarray:
        """Every query token's fingerprint (written to its slot)."""
        T, B = ids.size, query_lens.size
        h = token_hash(ids, positions)
        fp0 = np.full(B, self.root, dtype=U64)
        has = prev_slot >= 0
        fp0[has] = self.store[prev_slot[has]]
        if T == B:  # one token each (decodes): fp = fp0 * MULT + h
            fp = fp0 * U64(MULT) + h
        else:
            # within a run starting at flat index q0: fp[t] = fp0 * M^(t - q0 + 1) + sum_{k=q0..t} h[k] M^(t - k)
            #                                            = M^t * (fp0 * M^-q0 * M + C[t] - C[q0 - 1]), C = cumsum(h * M^-k)
            P, Q = self._powers(T)
            C = np.concatenate([np.zeros(1, dtype=U64), np.cumsum(h * Q, dtype=U64)])
            q0 = np.cumsum(query_lens) - query_lens
            seq = np.repeat(np.arange(B), query_lens)
            base = q0[seq]
            fp = P * (fp0[seq] * Q[base] * U64(MULT) + C[1:] - C[base])
        self.store[slots] = fp
        return fp


def map_shared(fd: int, size: int) -> mmap.mmap:
    """A shared read-write mapping of a file, its pages allocated now where the OS can (MAP_POPULATE)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _read_exact(f, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise EOFError
        got += k
    return bytes(buf)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve(vocab: int, num_slots: int, seed: int, pool_rows: int) -> None:
    inp, out = sys.stdin.buffer.raw, sys.stdout.fileno()
    pool = np.random.default_rng(seed).standard_normal((pool_rows, vocab), dtype=np.float32)
    fps = Fingerprints(num_slots, seed)
    buffers: dict[int, np.ndarray] = {}
    while True:
        try:
            op, job, k, a, b, c, d, _ = HEADER.unpack(_read_exact(inp, HEADER.size))
        except EOFError:
            return
        if op == STOP:
            return
        if op == ATTACH:
            path = _read_exact(inp, b).decode()
            with open(path, "r+b") as f:
                mm = map_shared(f.fileno(), a * vocab * 4)
            os.unlink(path)  # both processes hold their mappings: the memory lives until both unmap it
            buffers[k] = np.frombuffer(mm, dtype=np.float32).reshape(a, vocab)
            continue
        if op == COPY:
            fps.store[b : b + c] = fps.store[a : a + c]
            continue
        T, B, R, P = a, b, c, d
        arr = np.frombuffer(_read_exact(inp, 8 * (3 * T + 2 * B + R + P)), dtype=np.int64)
        began = time.perf_counter()
        try:
            ids, positions, slots = arr[:T].copy(), arr[T : 2 * T], arr[2 * T : 3 * T]
            query_lens, prev_slot = arr[3 * T : 3 * T + B], arr[3 * T + B : 3 * T + 2 * B]
            rows = arr[3 * T + 2 * B : 3 * T + 2 * B + R]
            prev = arr[3 * T + 2 * B + R :]
            ph = ids < 0
            if ph.any():  # the previous step's sampled tokens, as ModelRunner._forward reads them
                if not P:
                    raise ValueError("a placeholder input id without the previous step's tokens")
                ids[ph] = prev[np.clip(-ids[ph] - 1, 0, P - 1)]
            fp = fps.step(ids, positions, slots, query_lens, prev_slot)
            if R:
                idx = (mix(fp[rows] ^ U64(seed & _M64)) % U64(pool_rows)).astype(np.int64)
                # one memcpy a row: numpy.take(axis=0, out=...) took 9.3 ms for 256 rows of 49152, this 1.6
                buf = buffers[k]
                for i, j in enumerate(idx.tolist()):
                    np.copyto(buf[i], pool[j])
        except Exception as e:  # reported to the step's waiter, which raises it
            msg = f"{type(e).__name__}: {e}".encode()
            _write_all(out, REPLY.pack(job, -1.0, -1.0) + struct.pack("<q", len(msg)) + msg)
            continue
        _write_all(out, REPLY.pack(job, began, time.perf_counter()))


def yield_to_the_host() -> None:
    """Run only where the engine's threads leave a core free (SCHED_IDLE; else the lowest nice level).
    At normal priority the process, woken by a request while the other core was taken (this 2-core
    host is shared), preempted the engine's thread on its own core: the engine's pipe write took 1.2 ms
    at batch 64 (the rows' write), host time no device costs. Now its work waits for a free core or for
    the engine to wait, and a step that ends late for that shows in the device's time per step."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


if __name__ == "__main__":
    yield_to_the_host()
    serve(*(int(x) for x in sys.argv[1:5]))
