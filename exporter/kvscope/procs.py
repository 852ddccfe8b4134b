"""Stopping a child process (or its whole process group) by PID, boundedly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float = 10.0,
                 *, group: bool = False) -> int | None:
    """SIGTERM the process (its group when ``group``: started with start_new_session), then
    SIGKILL after ``timeout_s``; reap it. Returns its exit code. Idempotent."""
    if proc.poll() is None:
        kill = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
        with contextlib.suppress(ProcessLookupError):
            kill(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                kill(signal.SIGKILL)
            proc.wait()
    return proc.returncode
