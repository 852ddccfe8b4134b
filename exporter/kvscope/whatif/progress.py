"""Progress of a ``kvscope whatif`` run on stderr, one line per setting."""

from __future__ import annotations

import sys
import time
from typing import Any

from kvscope.whatif.measure import Measurement

_CLEAR = "\r\033[K"  # carriage return, erase to the end of the line


class Progress:
    """Per setting: one line rewritten in place on a terminal, a final line otherwise."""

    def __init__(self, total: int, stream: Any = None, quiet: bool = False) -> None:
        self.total, self.quiet = total, quiet
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.index, self.name, self.last = 0, "", 0.0

    def start(self, index: int, name: str) -> None:
        self.index, self.name, self.last = index, name, time.monotonic()

    def step(self, steps: int, preemptions: int) -> None:
        now = time.monotonic()
        if self.quiet or not self.tty or now - self.last < 0.25:
            return
        self.last = now
        self.stream.write(f"{_CLEAR}[{self.index}/{self.total}] {self.name}: step {steps}, "
                          f"{preemptions} preemptions")
        self.stream.flush()

    def done(self, m: Measurement) -> None:
        if not self.quiet:
            self.stream.write((_CLEAR if self.tty else "") + f"[{self.index}/{self.total}] "
                              f"{self.name}: {m.steps} steps, {m.preemptions_total} "
                              f"preemptions, {m.wall_seconds:.1f} s\n")
            self.stream.flush()
