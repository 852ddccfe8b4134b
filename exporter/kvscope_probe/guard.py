"""The one wrapper factory every class-level hook goes through, and their registry.

A hook is vLLM's method plus kvscope's work around it, split in three parts that run
inside one guard each: ``rec_of`` (find the Recorder, attaching it if need be),
``before`` (facts vLLM's call is about to change) and ``after`` (facts it produced).
The wrapper passes ``*args, **kwargs`` to vLLM's method unchanged and returns its result
unchanged; an exception in any of kvscope's parts is counted (``Recorder.fault``) and
never re-raised, and vLLM's call still happens exactly once. The one liberty taken:
an argument named in ``materialize`` that is a one-shot iterator is replaced by a list
of the same items, so ``after`` can read what vLLM consumed.

``REGISTRY`` lists every installed hook by name; the containment test injects a fault
into each part of each entry in turn (``tests/twin/test_probe_containment.py``), so a
hook added later is covered without editing the test.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvscope_probe")
_now_ns = time.perf_counter_ns
_SKIP = object()

Part = Callable[..., Any]


class Hook:
    """One installed wrapper: where it is, vLLM's original, and kvscope's parts (read
    on every call, so a test can swap one for a faulting stand-in)."""

    def __init__(self, name: str, owner: Any, attr: str, orig: Callable[..., Any], *,
                 rec_of: Part, before: Part | None, after: Part | None,
                 timed: bool, materialize: tuple[int, str] | None) -> None:
        self.name = name
        self.owner = owner
        self.attr = attr
        self.orig = orig
        self.rec_of = rec_of
        self.before = before
        self.after = after
        self.timed = timed
        self.materialize = materialize
        self.unguarded_faults = 0
        """Faults with no Recorder to count them (``rec_of`` itself failed)."""


REGISTRY: dict[str, Hook] = {}


def rec_of_self(args: tuple[Any, ...]) -> Any:
    """The Recorder bound to the hooked object (``self``), or None."""
    return args[0]._kvscope


def arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    """Argument ``index`` after ``self`` (1-based in ``args``), passed either way."""
    return args[index] if len(args) > index else kwargs[name]


def fault(hook: Hook, rec: Any, exc: Exception) -> None:
    """Count ``exc`` on ``rec``; without one, on the hook (logged once)."""
    try:
        if rec is not None and hasattr(rec, "fault"):
            rec.fault(hook.name, exc)
            return
        hook.unguarded_faults += 1
        if hook.unguarded_faults == 1:
            log.warning("kvscope probe: contained an error in %s: %r", hook.name, exc)
    except Exception:  # noqa: BLE001 - counting must not raise either
        pass


def _prepare(h: Hook, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[Any, Any, tuple[Any, ...], int]:
    """kvscope's work before vLLM's call: (rec, before's state or _SKIP, args, ns)."""
    rec = None
    t = _now_ns()
    try:
        rec = h.rec_of(args)
        if rec is None or not rec.enabled:
            return rec, _SKIP, args, 0
        if h.materialize is not None:
            i, name = h.materialize
            if len(args) > i:
                if iter(args[i]) is args[i]:
                    args = (*args[:i], list(args[i]), *args[i + 1:])
            elif name in kwargs and iter(kwargs[name]) is kwargs[name]:
                kwargs[name] = list(kwargs[name])
        state = h.before(rec, args, kwargs) if h.before is not None else None
    except Exception as exc:  # noqa: BLE001 - the probe never raises into vLLM
        fault(h, rec, exc)
        return rec, _SKIP, args, 0
    return rec, state, args, (_now_ns() - t if h.timed else 0)


def _finish(h: Hook, rec: Any, state: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any], ret: Any, spent: int) -> None:
    """kvscope's work after vLLM's call."""
    t = _now_ns()
    try:
        if h.after is not None:
            h.after(rec, args, kwargs, ret, state)
        if h.timed:
            rec.wrap_ns += _now_ns() - t + spent
    except Exception as exc:  # noqa: BLE001 - the probe never raises into vLLM
        fault(h, rec, exc)


def install(owner: Any, attr: str, *, name: str | None = None, rec_of: Part = rec_of_self,
            before: Part | None = None, after: Part | None = None, timed: bool = True,
            materialize: tuple[int, str] | None = None,
            registry: dict[str, Hook] | None = None) -> Hook:
    """Replace ``owner.attr`` (vLLM's method, looked up in ``owner.__dict__`` or
    inherited) by a guarded wrapper and register it (in ``REGISTRY`` unless another
    ``registry`` is given: calibrate.py's stand-ins are not vLLM's)."""
    registry = REGISTRY if registry is None else registry
    orig = owner.__dict__.get(attr) or getattr(owner, attr)
    name = name or f"{owner.__name__}.{attr}"
    if name in registry and registry[name].owner is not owner:
        name = f"{owner.__module__}.{name}"  # two classes of one name
    h = Hook(name, owner, attr, orig, rec_of=rec_of,
             before=before, after=after, timed=timed, materialize=materialize)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec, state, args, spent = _prepare(h, args, kwargs)
        ret = orig(*args, **kwargs)
        if state is not _SKIP:
            _finish(h, rec, state, args, kwargs, ret, spent)
        return ret

    wrapper.__name__ = getattr(orig, "__name__", attr)
    wrapper.__qualname__ = getattr(orig, "__qualname__", attr)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    wrapper._kvscope_hook = h  # type: ignore[attr-defined]
    setattr(owner, attr, wrapper)
    registry[h.name] = h
    return h
