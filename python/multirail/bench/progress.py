"""Progress for long bench runs, on stderr only (stdout carries the table or `--json -`).

* stderr is a terminal: for runs that count (kv requests), a tqdm bar when tqdm is installed
  (`pip install tqdm`, or the `multirail[plot]` extra); otherwise, and for free-text progress
  (the sweep), the single updating line of `core.Progress`.
* stderr is not a terminal (CI logs, a pipe): plain lines, at most one every `interval_s`
  (10 s), and none at all for runs shorter than that, so short runs and tests print nothing.
* disabled (the caller's choice): nothing.

Every kind has the `update(text)` / `clear()` interface that `worker.run_sweep` uses, plus
`advance(n, text)` for runs that count units of work (`bench kv` counts requests).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from multirail.bench.core import Progress


class PlainLines:
    """One line per `interval_s` at most, the first only after `interval_s` has passed."""

    def __init__(self, stream: TextIO, total: int | None = None, desc: str = "",
                 interval_s: float = 10.0) -> None:
        self.stream, self.total, self.desc, self.interval_s = stream, total, desc, interval_s
        self.done = 0
        self._start = self._last = time.monotonic()
        self._text = ""

    def _maybe_print(self) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        count = f" {self.done}/{self.total}" if self.total else ""
        text = f" {self._text}" if self._text else ""
        print(f"[{now - self._start:6.0f} s] {self.desc}{count}{text}".rstrip(), file=self.stream, flush=True)

    def update(self, text: str) -> None:
        self._text = text
        self._maybe_print()

    def advance(self, n: int = 1, text: str | None = None) -> None:
        self.done += n
        if text is not None:
            self._text = text
        self._maybe_print()

    def clear(self) -> None:
        pass


class TqdmBar:
    """A tqdm bar (counts with `advance`, free text with `update`)."""

    def __init__(self, tqdm_cls: Any, stream: TextIO, total: int | None, desc: str) -> None:
        self.bar = tqdm_cls(total=total, desc=desc, file=stream, leave=False, dynamic_ncols=True, unit="req")

    def update(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=True)

    def advance(self, n: int = 1, text: str | None = None) -> None:
        if text is not None:
            self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(n)

    def clear(self) -> None:
        self.bar.close()  # idempotent in tqdm


class LineCounter(Progress):
    """core.Progress (one updating line) that also counts."""

    def __init__(self, stream: TextIO, total: int | None, desc: str) -> None:
        super().__init__(True, stream)
        self.total, self.desc, self.done = total, desc, 0

    def advance(self, n: int = 1, text: str | None = None) -> None:
        self.done += n
        count = f" {self.done}/{self.total}" if self.total else ""
        self.update(f"{self.desc}{count} {text or ''}".rstrip())


class Silent:
    def update(self, text: str) -> None:
        pass

    def advance(self, n: int = 1, text: str | None = None) -> None:
        pass

    def clear(self) -> None:
        pass


def make_progress(enabled: bool = True, total: int | None = None, desc: str = "",
                  stream: TextIO | None = None, interval_s: float = 10.0) -> Any:
    """The progress display for this stream (see the module docstring)."""
    stream = stream or sys.stderr
    if not enabled:
        return Silent()
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        return PlainLines(stream, total, desc, interval_s)
    try:
        width = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        width = 0
    if total is None or width <= 0:  # free text only (the sweep), or a terminal of unknown width
        return LineCounter(stream, total, desc)
    try:
        from tqdm import tqdm
    except ImportError:
        return LineCounter(stream, total, desc)
    return TqdmBar(tqdm, stream, total, desc)
