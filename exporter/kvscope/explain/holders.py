"""Who held the pool at a step: blocks per request from the lifecycle events, grouped by
request, client and user agent; and whether a waiting request could ever have fitted.

A request's blocks as a step began are the ``total_blocks`` of its last event before that
step (0 after it was queued, preempted or ended, and for one whose end came in that step's
record: ``source.live_events``), so the figure is the tracker's own ledger of the request,
not a sample; blocks a sliding-window group gave back are an allocation entry of their own
(negative blocks), so it is not the most the request held.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kvscope.state.capacity import full_attention_blocks

HOLDING = ("admitted", "resumed", "allocated", "taken_up")
TOP = 5


def blocks_held(events: list[dict]) -> dict[str, int]:
    """Blocks each request held after the last of ``events`` (in order), when > 0."""
    held: dict[str, int] = {}
    for e in events:
        if e["event"] in HOLDING and e["total_blocks"] >= 0:
            held[e["request_id"]] = e["total_blocks"]
        elif e["event"] not in HOLDING:
            held.pop(e["request_id"], None)
    return {r: b for r, b in held.items() if b > 0}


def top_holders(held: dict[str, int], who: dict[str, dict], top: int = TOP) -> dict[str, Any]:
    """The top ``top`` holders by request, client and user agent; ``who`` maps a request
    to its trace or client row (client_id, user_agent; missing: unknown)."""
    total = sum(held.values())
    by: dict[str, dict[str, int]] = {"client": defaultdict(int), "user_agent": defaultdict(int)}
    for rid, n in held.items():
        row = who.get(rid, {})
        by["client"][row.get("client_id") or "(unknown)"] += n
        by["user_agent"][row.get("user_agent") or "(unknown)"] += n

    def ranked(d: dict[str, int]) -> list[dict[str, Any]]:
        items = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        return [{"key": k, "blocks": n} for k, n in items]

    return {"held_blocks": total, "requests": len(held), "by_request": ranked(held),
            "by_client": ranked(by["client"]), "by_user_agent": ranked(by["user_agent"])}


def trigger_event(step_events: list[dict], requester: str) -> dict | None:
    """The requester's own event in the preemption's step: its growth there (None: no
    such event, or no requester recorded). vLLM preempts only while it grows running
    requests, and a step that preempts admits and resumes nothing (0.32 scheduler.py
    900), so the event found is an allocation (not a sliding window's blocks given back:
    an entry of negative blocks)."""
    if not requester:
        return None
    return next((e for e in step_events if e["request_id"] == requester
                 and e["event"] in HOLDING and e["blocks"] >= 0), None)


def could_fit(trace: dict | None, config: dict | None, never_fits: list[dict], rid: str,
              layout_blocks: int) -> dict[str, Any]:
    """Whether the request could ever fit the pool, claimed only as far as it is known.

    The pool is the engine's settings' (``engine_configs``), else the layout sample's
    (``layout_blocks``, -1 none); its usable blocks leave out the null block. The request's
    need is bounded below by its full-attention groups' blocks at its full length (prompt
    and output, from its trace): they keep a block per ``block_size`` tokens of the whole
    sequence, where sliding-window and Mamba groups hold fewer (``kvscope.state.capacity``,
    the sidecar's own never-fits rule). It could not fit when the sidecar's ``never_fits``
    decision names it, or when that bound passes the usable blocks."""
    named = [d for d in never_fits if d["request_id"] == rid]
    pool = config["num_blocks"] if config else layout_blocks
    usable = pool - 1 if pool > 0 else -1
    full = -1
    if trace is not None and config is not None:
        full = full_attention_blocks(
            zip(config["kv_group_kinds"], config["kv_group_block_sizes"], strict=False),
            trace["prompt_len"] + trace["output_len"])
    return {"never_fits_decisions": len(named),
            "required_blocks": trace["required_blocks"] if trace else -1,
            "full_attention_blocks": full, "pool_blocks": pool, "usable_blocks": usable,
            "fits": not named and (full < 0 or usable < 0 or full <= usable)}
