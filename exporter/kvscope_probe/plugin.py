"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls ``register()`` in every one of its processes. It does nothing unless
``KVSCOPE_PROBE_ENDPOINT`` is set; then it patches the scheduler and block pool classes.
Sockets and threads start lazily, on the first scheduler call, so only the EngineCore
process (the one that schedules) records and sends anything.

Environment:
- ``KVSCOPE_PROBE_ENDPOINT``: ZMQ endpoint the sidecar binds (``ipc://...`` or ``tcp://...``)
- ``KVSCOPE_SERVER``: which vLLM server (default: its API server's host:port)
- ``KVSCOPE_ENGINE``: engine label (default: the data-parallel index, as vLLM's ``engine``)
- ``KVSCOPE_PROBE_SECRET`` / ``KVSCOPE_PROBE_SECRET_FILE``: the shared secret a tcp
  endpoint requires (``kvscope_probe.transport``)
- ``KVSCOPE_PROBE_RING``: ring capacity in records (default 8192)
- ``KVSCOPE_PROBE_KEYFRAME_S``: seconds between keyframes (default 5)
- ``KVSCOPE_PROBE_HWM``: frames queued for a sidecar that does not read (default 128,
  each at most 1 MiB)
- ``KVSCOPE_PROBE_FLUSH_S``: seconds between the sender's wakeups (default 0.1,
  0.01 to 1): shorter is fresher and costs the engine more (``kvscope_probe.sender``)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("kvscope_probe")

ENV_ENDPOINT = "KVSCOPE_PROBE_ENDPOINT"
TESTED_VLLM = ("0.32", "0.33")
"""vLLM minor versions kvscope is tested against (the twin on both, servers on 0.32)."""
_lock = threading.Lock()
_version_noted = False
_senders: list[Any] = []
_endpoint: str | None = None


def _int_env(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


def _float_env(name: str, default: float, low: float = 0.05, high: float = 1e9) -> float:
    try:
        return min(high, max(low, float(os.environ.get(name, default))))
    except ValueError:
        return default


def bind(sched: Any, rec: Any) -> None:
    """Point the scheduler and its pool at one Recorder."""
    sched._kvscope = rec
    rec.pool._kvscope = rec
    rec.watch_need(rec.pool.get_num_free_blocks())


def attach(sched: Any) -> Any:
    """Create the Recorder and Sender for one Scheduler; None when that fails (the
    scheduler is then marked, never tried again)."""
    try:
        from kvscope_probe.recorder import Recorder
        from kvscope_probe.sender import DEFAULT_HWM, FLUSH_INTERVAL_S, Sender
    except Exception as exc:  # noqa: BLE001 - a broken install: tried once, not each step
        log.warning("kvscope probe: not recording this scheduler: %r", exc)
        sched._kvscope = _Off()
        return None

    with _lock:
        if sched.__dict__.get("_kvscope") is not None:
            return sched._kvscope
        if _endpoint is None:
            sched._kvscope = _Off()
            return None
        # Senders of schedulers vLLM dropped have ended (they hold their Recorder weakly).
        _senders[:] = [s for s in _senders if s.is_alive() or not s.ident]
        rec = sender = None
        try:
            rec = Recorder(
                sched,
                ring_size=_int_env("KVSCOPE_PROBE_RING", 8192),
                keyframe_interval_s=_float_env("KVSCOPE_PROBE_KEYFRAME_S", 5.0),
            )
            rec.push(rec.hello)
            # The pool as it is now: an engine that idles before its first step is in
            # sync at the sidecar at once (its ledger would read stale until then).
            rec.keyframe(time.perf_counter_ns())
            sender = Sender(
                rec,
                str(_endpoint),
                hwm=_int_env("KVSCOPE_PROBE_HWM", DEFAULT_HWM),
                flush_s=_float_env("KVSCOPE_PROBE_FLUSH_S", FLUSH_INTERVAL_S, 0.01, 1.0),
            )
            rec.stop = sender.stop_event
            sender.start()
            _senders.append(sender)
            _exit_flush_once()
            bind(sched, rec)
        except Exception as exc:  # noqa: BLE001
            log.warning("kvscope probe: not recording this scheduler: %r", exc)
            _give_up(rec, sender)
            sched._kvscope = _Off()
            return None
        log.info(
            "kvscope probe: recording engine %s (%d blocks) to %s",
            rec.hello.engine,
            rec.hello.num_blocks,
            sender.endpoint,
        )
        return rec


def _give_up(rec: Any, sender: Any) -> None:
    """Stop what a failed ``attach`` started: the sender's thread, and every hook that
    may already reach the Recorder (``bind`` points the pool at it before it arms the
    blocks-needed watch: left enabled, the pool's hooks would append every allocation
    and free to a Recorder whose steps never run again)."""
    if sender is not None:
        sender.stop_event.set()
        if sender in _senders:
            _senders.remove(sender)
    if rec is None:
        return
    rec.enabled = False  # every class-level hook reads this and passes through
    try:
        if getattr(rec.pool, "_kvscope", None) is rec:
            rec.pool._kvscope = None
        if rec.need_armed:
            from kvscope_probe.needhook import arm

            arm(rec, False)
    except Exception:  # noqa: BLE001 - giving up must not raise either
        pass


class _Off:
    """Marks a scheduler the probe gave up on, so it is not retried every step."""

    enabled = False


def register() -> None:
    """vLLM's plugin hook. Never raises: a failure logs one line and leaves vLLM alone."""
    endpoint = os.environ.get(ENV_ENDPOINT)
    if endpoint:
        enable(endpoint)


def version_warning(version: str) -> str | None:
    """The log line for a vLLM outside ``TESTED_VLLM``; None inside it."""
    if ".".join(version.split(".")[:2]) in TESTED_VLLM:
        return None
    return (
        f"kvscope probe: vLLM {version} is outside the tested range "
        f"({TESTED_VLLM[0]} to {TESTED_VLLM[-1]}); recording only what the structural "
        "check of its classes confirms; if kvscope_ledger_mismatches_total grows, its "
        "figures are not exact"
    )


def _note_version() -> None:
    """Log ``version_warning`` once per process."""
    global _version_noted
    if _version_noted:
        return
    _version_noted = True
    import vllm

    line = version_warning(str(getattr(vllm, "__version__", "unknown")))
    if line is not None:
        log.warning(line)


def enable(endpoint: str | None) -> bool:
    """Patch vLLM and record every scheduler to ``endpoint`` (None: only schedulers
    bound by hand with ``bind``). Returns whether the hooks are in place."""
    global _endpoint
    _endpoint = endpoint
    try:
        from kvscope_probe import hooks

        missing = hooks.missing_members()
        if missing:
            log.warning(
                "kvscope probe disabled: this vLLM lacks %s; kvscope is tested on vLLM %s",
                ", ".join(missing),
                " and ".join(TESTED_VLLM),
            )
            return False
        _note_version()
        from kvscope_probe import fingerprint

        off = fingerprint.check()
        if off:
            import vllm

            log.warning(fingerprint.line(off, str(getattr(vllm, "__version__", "unknown"))))
        if "core" in off:
            return False
        absent = hooks.install(attach, off)
        if absent:
            log.info("kvscope probe: optional hooks unavailable: %s", ", ".join(absent))
        return True
    except Exception as exc:  # noqa: BLE001
        log.warning("kvscope probe disabled: %r", exc)
        return False


def stop_all(timeout_s: float = 5.0) -> None:
    """Flush and stop every sender of this process (tests, the twin at exit, interpreter
    exit), waiting at most ``timeout_s`` in all. A sender flushes for at most about 2 s,
    then counts what it could not send as dropped; the frames its closed socket still
    queues go out while the probe's context ends, within what is left of ``timeout_s``."""
    senders = list(_senders)
    for s in senders:
        s.stop_event.set()
    deadline = time.monotonic() + timeout_s
    for s in senders:
        if s.ident is not None:
            s.join(max(0.0, deadline - time.monotonic()))
    _senders.clear()
    try:
        from kvscope_probe import iothreads

        iothreads.close_context(deadline - time.monotonic())
    except Exception as exc:  # noqa: BLE001 - never raise into vLLM's exit
        log.debug("kvscope probe: ending its ZMQ context failed: %r", exc)


EXIT_FLUSH_S = 1.0
"""At interpreter exit, how long the senders may take, in all, to send what their rings
still hold (they are daemon threads: without this the last records would be lost)."""
_exit_hooked = False


def _exit_flush_once() -> None:
    """Flush at exit where threads may still start and where a forked child ends too:
    ``threading._shutdown()`` runs the threading module's exit callbacks before it joins
    the threads, at interpreter exit and at the end of a forked multiprocessing child
    (vLLM's engine core), which exits with ``os._exit`` and runs no atexit handler; and
    Python 3.12 refuses a thread started in an atexit handler (ending the context starts
    one). ``atexit`` only where that hook is missing (the way concurrent.futures ends its
    workers)."""
    global _exit_hooked
    if not _exit_hooked:
        _exit_hooked = True
        import threading

        hook = getattr(threading, "_register_atexit", None)
        if callable(hook):
            hook(stop_all, EXIT_FLUSH_S)
        else:
            import atexit

            atexit.register(stop_all, EXIT_FLUSH_S)
