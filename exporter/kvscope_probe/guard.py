"""The one wrapper factory every class-level hook goes through, and their registry.

A hook is vLLM's method plus kvscope's work around it, split in three parts that run
inside one guard each: ``rec_of`` (find the Recorder, attaching it if need be),
``before`` (facts vLLM's call is about to change) and ``after`` (facts it produced).
A ``before`` that sets Recorder state for the span of vLLM's call has an ``undo``, run
instead of ``after`` when vLLM's method raises, before its exception goes on unchanged:
no mark outlives the call it belongs to.
The wrapper passes ``*args, **kwargs`` to vLLM's method unchanged and returns its result
unchanged; an exception in any of kvscope's parts is counted (``Recorder.fault``) and
never re-raised, and vLLM's call still happens exactly once. The one liberty taken:
an argument named in ``materialize`` that is a one-shot iterator is replaced by a list
of the same items, so ``before`` and ``after`` can read what vLLM consumed (vLLM's block
pool reads each such argument once, start to end). An iterator that raises partway is
handed to vLLM as the items read before the error and then the same error, as vLLM's
own loop would have met them; that call is not recorded (a fault: the mirror is
repaired).

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
    on every call, so a test can swap one for a faulting stand-in). A hook installed with
    no ``before``, no ``materialize`` and untimed calls vLLM first and finds its Recorder
    after (``rec_of`` and ``after`` in one guard): a ``before`` set on it later is not
    called."""

    def __init__(self, name: str, owner: Any, attr: str, orig: Callable[..., Any], *,
                 rec_of: Part, before: Part | None, after: Part | None,
                 undo: Part | None, timed: bool,
                 materialize: tuple[int, str] | None) -> None:
        self.name = name
        self.owner = owner
        self.attr = attr
        self.orig = orig
        self.rec_of = rec_of
        self.before = before
        self.after = after
        self.undo = undo
        """``undo(rec, args, kwargs, state)``: when vLLM's method raised, what ``before``
        set is reset (``state``: what ``before`` returned)."""
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


class PartlyRead(Exception):
    """A one-shot argument raised while it was read; ``args`` (and the ``kwargs`` changed
    in place) hand vLLM its items read so far, then the same error."""

    def __init__(self, args: tuple[Any, ...], error: BaseException) -> None:
        super().__init__(f"an argument raised while read: {error!r}")
        self.call_args = args


def _replay(items: list[Any], error: BaseException) -> Any:
    yield from items
    raise error


def _materialize(spec: tuple[int, str], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``args`` with the one-shot iterator named by ``spec`` replaced by a list of its items
    (a keyword argument is replaced in ``kwargs`` itself); ``PartlyRead`` when reading it
    raised."""
    i, name = spec
    if len(args) > i:
        it = args[i]
    elif name in kwargs:
        it = kwargs[name]
    else:
        return args
    if iter(it) is not it:
        return args
    items: list[Any] = []
    error: BaseException | None = None
    try:
        items.extend(it)
    except BaseException as exc:  # noqa: BLE001 - vLLM meets it, below, not the probe
        error = exc
    value = items if error is None else _replay(items, error)
    if len(args) > i:
        args = (*args[:i], value, *args[i + 1:])
    else:
        kwargs[name] = value
    if error is not None:
        raise PartlyRead(args, error)
    return args


def install(owner: Any, attr: str, *, name: str | None = None, rec_of: Part = rec_of_self,
            before: Part | None = None, after: Part | None = None,
            undo: Part | None = None, timed: bool = True,
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
    h = Hook(name, owner, attr, orig, rec_of=rec_of, before=before, after=after,
             undo=undo, timed=timed, materialize=materialize)

    def after_only(*args: Any, **kwargs: Any) -> Any:
        # No before part, nothing to materialise, untimed (get_new_blocks: every
        # allocation): vLLM's call first, then finding the Recorder and the after part in
        # one guard; half the bytecodes of the general wrapper below.
        ret = orig(*args, **kwargs)
        rec = None
        try:
            rec_of = h.rec_of
            rec = args[0]._kvscope if rec_of is rec_of_self else rec_of(args)
            if rec is not None and rec.enabled:
                after = h.after
                if after is not None:
                    after(rec, args, kwargs, ret, None)
        except Exception as exc:  # noqa: BLE001 - the probe never raises into vLLM
            fault(h, rec, exc)
        return ret

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # kvscope's work before and after vLLM's call, each part in one guard; inlined
        # (no helper calls, no clock reads for an untimed hook): this runs on every
        # block-pool call of the engine thread.
        rec = None
        state: Any = _SKIP
        spent = 0
        try:
            rec_of = h.rec_of
            rec = args[0]._kvscope if rec_of is rec_of_self else rec_of(args)
            if rec is not None and rec.enabled:
                timed = h.timed
                t = _now_ns() if timed else 0
                if h.materialize is not None:
                    args = _materialize(h.materialize, args, kwargs)
                before = h.before
                state = None if before is None else before(rec, args, kwargs)
                if timed:
                    spent = _now_ns() - t
        except Exception as exc:  # noqa: BLE001 - the probe never raises into vLLM
            fault(h, rec, exc)
            state = _SKIP
            if type(exc) is PartlyRead:
                args = exc.call_args
        try:  # no cost unless vLLM raises (3.11's exception tables)
            ret = orig(*args, **kwargs)
        except BaseException:
            if state is not _SKIP and h.undo is not None:
                try:
                    h.undo(rec, args, kwargs, state)
                except Exception as exc:  # noqa: BLE001 - vLLM's error goes on, not ours
                    fault(h, rec, exc)
            raise
        if state is not _SKIP:
            try:
                timed = h.timed
                t = _now_ns() if timed else 0
                after = h.after
                if after is not None:
                    after(rec, args, kwargs, ret, state)
                if timed:
                    rec.wrap_ns += _now_ns() - t + spent
            except Exception as exc:  # noqa: BLE001 - the probe never raises into vLLM
                fault(h, rec, exc)
        return ret

    if before is None and materialize is None and not timed:
        wrapper = after_only
    wrapper.__name__ = getattr(orig, "__name__", attr)
    wrapper.__qualname__ = getattr(orig, "__qualname__", attr)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    wrapper._kvscope_hook = h  # type: ignore[attr-defined]
    setattr(owner, attr, wrapper)
    registry[h.name] = h
    return h
