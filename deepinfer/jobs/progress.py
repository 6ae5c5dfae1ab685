"""Job progress: a tqdm bar on a terminal, plain periodic log lines on stderr otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _fmt_eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Counts records, tokens and failures; renders them as a bar (tty) or log lines (not a tty)."""

    def __init__(self, total: int | None, already_done: int = 0, stream: TextIO | None = None,
                 log_interval: float = 10.0, enabled: bool = True, use_bar: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.already = total, already_done
        self.done = self.failed = self.tokens = 0
        self.t0 = time.monotonic()
        self.log_interval, self.enabled = log_interval, enabled
        self._last_log = self.t0
        self._bar = None
        is_tty = getattr(self.stream, "isatty", lambda: False)()
        if enabled and (use_bar if use_bar is not None else is_tty):
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=already_done, unit="rec", file=self.stream, dynamic_ncols=True)

    def elapsed(self) -> float:
        return max(time.monotonic() - self.t0, 1e-9)

    def update(self, ok: bool, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        if not ok:
            self.failed += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{self.tokens / self.elapsed():.1f} tok/s, {self.failed} failed", refresh=False)
            return
        now = time.monotonic()
        if now - self._last_log >= self.log_interval:
            self._last_log = now
            print(self.line(), file=self.stream, flush=True)

    def line(self) -> str:
        el = self.elapsed()
        rate = self.done / el
        pos = self.already + self.done
        if self.total is not None:
            left = max(self.total - pos, 0)
            eta = _fmt_eta(left / rate) if rate > 0 else "?"
            head = f"{pos}/{self.total} records ({100.0 * pos / max(self.total, 1):.1f}%)"
        else:
            head, eta = f"{pos} records", "?"
        return (f"[deepinfer run] {head}, {rate:.2f} rec/s, {self.tokens / el:.1f} tok/s, "
                f"{self.failed} failed, ETA {eta}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
