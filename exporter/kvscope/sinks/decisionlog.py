"""Layer 4: one JSON line per scheduler decision, for Alloy / promtail to ship to Loki.

Lines go to stdout or to a size-rotated file. Each line carries a stable ``msg`` (so a
LogQL line filter like ``|= "Preempting request"`` keeps working) and the facts as fields.
No prompt or completion text ever reaches this log: rows carry IDs, counts and reasons.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from datetime import datetime, timezone
from typing import IO, Any

from kvscope.sinks.rows import SchedulerDecision


def decision_line(d: SchedulerDecision) -> str:
    """The JSON line for one decision (keys stable; documented in the README)."""
    return json.dumps({
        "ts": datetime.fromtimestamp(d.ts, tz=timezone.utc).isoformat(timespec="milliseconds"),
        "level": "info",
        "logger": "kvscope.decisions",
        "engine": d.engine,
        "model": d.model,
        "event": d.decision,
        "request_id": d.request_id,
        "reason": d.reason or None,
        "blocks_needed": None if d.blocks_needed < 0 else d.blocks_needed,
        "free_blocks": None if d.free_blocks < 0 else d.free_blocks,
        "max_contiguous": None if d.max_contiguous_free < 0 else d.max_contiguous_free,
        "tokens": None if d.tokens < 0 else d.tokens,
        "policy": d.policy,
        "msg": d.msg,
    }, separators=(",", ":"))


class DecisionLog:
    """Writes decision lines to a stream or a file rotated at ``max_bytes``."""

    name = "decision_log"

    def __init__(self, path: str | None = None, *, max_bytes: int = 50 << 20,
                 backups: int = 5, stream: IO[str] | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.lines = 0
        self.lock = threading.Lock()
        self._stream = stream
        self._file: IO[str] | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open

    def accepts(self, table: str) -> bool:
        return table == "scheduler_decisions"

    def write(self, table: str, row: Any) -> None:
        line = decision_line(row) + "\n"
        with self.lock:
            if self._file is not None:
                self._file.write(line)
                if self._file.tell() >= self.max_bytes:
                    self._rotate()
            else:
                (self._stream or sys.stdout).write(line)
            self.lines += 1

    def _rotate(self) -> None:
        assert self._file is not None and self.path
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def flush(self, timeout_s: float = 0.0) -> None:
        with self.lock:
            (self._file or self._stream or sys.stdout).flush()

    def close(self, timeout_s: float = 0.0) -> None:
        self.flush()
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None
