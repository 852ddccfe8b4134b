"""Layer 5's counters: per client and per User-Agent, with bounded label values."""

from __future__ import annotations

from dataclasses import dataclass, field


def client_label(client_id: str, api_key_hash: str) -> str:
    if client_id:
        return client_id
    if api_key_hash:
        return f"key:{api_key_hash[:8]}"
    return "anonymous"


class LabelSlots:
    """At most ``limit`` distinct label values; the rest become ``other``. ``overflow``
    counts the requests folded into ``other``: once each, where ``count`` is true (a
    request's row; its traces ask again with ``count=False``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.values: set[str] = set()
        self.overflow = 0

    def __call__(self, value: str, *, count: bool = True) -> str:
        value = "".join(ch for ch in value[:256] if ch.isprintable())[:64] or "empty"
        if value in self.values:
            return value
        if len(self.values) < self.limit:
            self.values.add(value)
            return value
        self.overflow += count
        return "other"


@dataclass
class ClientStats:
    """Per-client and per-user-agent counters, labels bounded by LabelSlots."""

    clients: LabelSlots
    agents: LabelSlots
    requests: dict[str, int] = field(default_factory=dict)
    duplicates: dict[str, int] = field(default_factory=dict)
    preempted_requests: dict[str, int] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    agent_requests: dict[str, int] = field(default_factory=dict)
    agent_preemptions: dict[str, int] = field(default_factory=dict)
    unjoined_traces: int = 0
    ambiguous_traces: int = 0
    """Of the unjoined: traces whose request ID several concurrent calls shared."""
    joined_traces: int = 0

    @staticmethod
    def bump(d: dict[str, int], key: str, n: int = 1) -> None:
        d[key] = d.get(key, 0) + n
