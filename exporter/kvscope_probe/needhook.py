"""The blocks-needed hook: ``KVCacheCoordinator.get_num_blocks_to_allocate`` observed.

While the pool is low it runs once per scheduled request on every step, so its call layer
is most of its cost. vLLM calls it with nine keywords; a ``(*args, **kwargs)`` wrapper
builds a dict of them and unpacks it again into vLLM's positional-or-keyword parameters
(0.45 µs a call over vLLM's own on CPython 3.11: 35 µs a step at 77 requests in a
saturated pool, benchmarks/probe_micro.py). The hook is therefore generated with the
installed method's own signature, read when first armed, and calls it positionally
(0.06-0.07 µs a call). A signature it cannot copy
(``*args``, ``**kwargs``, positional-only, no ``request_id``) gets the generic wrapper.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_P = inspect.Parameter
_NAMES = {"_o", "_coord", "_rec", "_fault", "exc", "n"}


def arm_below(sched: Any, hello: Any) -> int:
    """Free blocks at or below which an allocation of the next step could fail.

    None can fail while more blocks are free than the step can take: each scheduled
    request gets at most cdiv(its new tokens, block size) + 1 blocks per group, and new
    tokens (lookahead included) are bounded by the budget."""
    sizes = [g.block_size for g in hello.kv_groups]
    look = int(getattr(sched, "num_lookahead_tokens", 0) or 0)
    per_group = (-(-(hello.token_budget + look * hello.max_num_seqs) // min(sizes))
                 + hello.max_num_seqs)
    return per_group * len(sizes)


def arm(rec: Any, on: bool) -> None:
    """Shadow the coordinator's method with the hook (``on``) or remove it. The hook is
    not timed: two clock reads would cost more than it does, once per scheduled request
    (the step record adds calls x its calibrated cost; probe_micro measures it)."""
    coord = rec.mgr.coordinator
    if not on:
        # ``del``, never ``coord.__dict__``: on CPython 3.11+ reading an object's __dict__
        # moves its attributes out of their inline slots for good, and every attribute
        # read of vLLM's coordinator (its methods read self.* throughout) then takes the
        # slow generic path: +660 k instructions a step at 256 running (benchmarks/README.md)
        try:
            del coord.get_num_blocks_to_allocate
        except AttributeError:  # not armed: the class's method is the one vLLM calls
            pass
        rec.need_armed = False
        rec.need = None
        return
    if rec.need_fn is None:  # built once: signature() and exec cost ~0.1 ms
        rec.need_fn = need_hook(type(coord).get_num_blocks_to_allocate, coord, rec)
    coord.get_num_blocks_to_allocate = rec.need_fn
    rec.need_armed = True


def need_hook(o_need: Callable[..., int], coord: Any, rec: Any) -> Callable[..., int]:
    """A function that calls ``o_need(coord, ...)`` and stores ``(request_id, result)``
    in ``rec.need``; with ``o_need``'s signature when it can be copied."""
    src = _source(o_need)
    if src is None:
        return _generic(o_need, coord, rec)
    return _build(src, o_need, {"_o": o_need, "_coord": coord, "_rec": rec,
                                "_fault": _fault})


def stand_in(o_need: Callable[..., int]) -> tuple[Callable[..., int], dict[str, Any]]:
    """A method with ``o_need``'s signature that does nothing, and keywords to call it
    with as vLLM does (calibrate.py times the hook around it)."""
    params = _params(o_need)
    if params is None:
        return (lambda self, *a, **k: 0), {"request_id": "r"}
    sig, _ = _signature(params)
    src = f"def get_num_blocks_to_allocate(self, {sig}):\n    return 0\n"
    kwargs = {p.name: 0 for p in params if p.default is _P.empty}
    return _build(src, o_need, {}), {**kwargs, "request_id": "r"}


def _build(src: str, o_need: Callable[..., int], ns: dict[str, Any]) -> Callable[..., int]:
    params = _params(o_need) or []
    ns.update({f"_d_{p.name}": p.default for p in params if p.default is not _P.empty})
    exec(src, ns)  # noqa: S102 - our own source, built from parameter names only
    fn: Callable[..., int] = ns["get_num_blocks_to_allocate"]
    return fn


def _params(o_need: Callable[..., int]) -> list[inspect.Parameter] | None:
    """``o_need``'s parameters after ``self`` when the hook can copy them, else None."""
    try:
        params = list(inspect.signature(o_need).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kinds = {_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY}
    names = [p.name for p in params]
    if (not params or "request_id" not in names or any(p.kind not in kinds for p in params)
            or _NAMES & set(names) or any(n.startswith("_d_") for n in names)):
        return None
    return params


def _signature(params: list[inspect.Parameter]) -> tuple[str, str]:
    """The parameter list of a ``def`` with these parameters, and the arguments that
    pass them all on (positionally where they can be)."""
    sig: list[str] = []
    args: list[str] = []
    for p in params:
        if p.kind is _P.KEYWORD_ONLY and "*" not in sig:
            sig.append("*")
        sig.append(p.name if p.default is _P.empty else f"{p.name}=_d_{p.name}")
        args.append(p.name if p.kind is _P.POSITIONAL_OR_KEYWORD else f"{p.name}={p.name}")
    return ", ".join(sig), ", ".join(args)


def _source(o_need: Callable[..., int]) -> str | None:
    """The hook's source with ``o_need``'s parameters (after ``self``), or None."""
    params = _params(o_need)
    if params is None:
        return None
    sig, args = _signature(params)
    return (f"def get_num_blocks_to_allocate({sig}):\n"
            f"    n = _o(_coord, {args})\n"
            "    try:\n"
            "        _rec.need = (request_id, n)\n"
            "    except Exception as exc:\n"
            "        _fault(_rec, exc)\n"
            "    return n\n")


def _fault(rec: Any, exc: Exception) -> None:
    """Count a fault of the hook's own work; never raise (try: rec is the probe's)."""
    try:
        rec.fault("get_num_blocks_to_allocate", exc)
    except Exception:  # noqa: BLE001
        pass


def _generic(o_need: Callable[..., int], coord: Any, rec: Any) -> Callable[..., int]:
    """The hook for a signature it cannot copy. Which request asks is known only when
    vLLM passes ``request_id`` by keyword (as it does): never guessed from position."""

    def get_num_blocks_to_allocate(*args: Any, **kwargs: Any) -> int:
        n = o_need(coord, *args, **kwargs)
        try:
            rec.need = (kwargs["request_id"], n) if "request_id" in kwargs else None
        except Exception as exc:  # noqa: BLE001 - the probe never raises into vLLM
            _fault(rec, exc)
        return n

    return get_num_blocks_to_allocate
