"""Layout history older than the sampler's memory, read back from ClickHouse."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvscope.layout.snapshot import GroupTable, Owner, Snapshot, encode_runs
from kvscope.store.rows import LayoutSnapshotRow
from kvscope_probe import wire

COLUMNS = ("ts, model, engine, session, step, num_blocks, free_blocks, cached_blocks, "
           "used_blocks, max_contiguous_free, budget_utilization, running, waiting, "
           "kv_group_kinds, states, block_group, owner, owner_req_ids, owner_blocks, "
           "owner_fragments, owner_group_runs, server")

StoreHistory = Callable[[str, float, float, int], list[Snapshot]]


def to_row(d: dict[str, Any]) -> LayoutSnapshotRow:
    """A layout_rows() dict as the row type the sinks route."""
    return LayoutSnapshotRow(**d)


def snapshot_from_row(r: tuple[Any, ...]) -> Snapshot:
    (ts, model, engine, session, step, num_blocks, free, cached, used, maxrun, util,
     running, waiting, kinds, states, group, owner, req_ids, blocks, frags, group_runs,
     server) = r
    runs = encode_runs(np.asarray(states, np.uint8), np.asarray(owner, np.int64) - 1,
                       np.asarray(group, np.int16))
    owners = tuple(Owner(q, int(b), int(f), -1, 0, _group_tables(t))
                   for q, b, f, t in zip(req_ids, blocks, frags, group_runs, strict=True))
    return Snapshot(engine=engine, model=model, session=session, ts=ts.timestamp(),
                    step=int(step), step_ts=0.0, num_blocks=int(num_blocks),
                    kv_groups=tuple(wire.KVGroup(k, 0) for k in kinds), runs=runs,
                    owners=owners, free_blocks=int(free), cached_blocks=int(cached),
                    used_blocks=int(used), max_contiguous_free=int(maxrun),
                    budget_utilization=None if util < 0 else float(util),
                    running=int(running), waiting=int(waiting), server=server)


def _group_tables(flat: list[list[int]]) -> tuple[GroupTable, ...]:
    """Per-group tables back from their flattened runs (first, length, ...)."""
    return tuple(GroupTable(tuple(zip(g[0::2], g[1::2], strict=True))) for g in flat)


def clickhouse_history(client: Callable[[], Any], database: str) -> StoreHistory:
    """A reader for layout_router: snapshots of one engine (its EngineState.key) in
    [t0, t1], oldest first."""

    def read(engine: str, t0: float, t1: float, limit: int) -> list[Snapshot]:
        result = client().query(
            f"SELECT {COLUMNS} FROM {database}.layout_snapshots "
            "WHERE if(server = '', engine, concat(server, '/', engine)) = {engine:String} "
            "AND ts BETWEEN fromUnixTimestamp64Milli({t0:Int64}, 'UTC') "
            "AND fromUnixTimestamp64Milli({t1:Int64}, 'UTC') "
            "ORDER BY ts DESC LIMIT {limit:UInt32}",
            parameters={"engine": engine, "t0": int(t0 * 1000), "t1": int(t1 * 1000),
                        "limit": limit})
        return [snapshot_from_row(r) for r in reversed(result.result_rows)]

    return read
