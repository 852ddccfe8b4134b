"""Layout history in ClickHouse ``layout_snapshots``: each sampled snapshot as a row, and the
rows read back when a query reaches past the sampler's memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvscope.layout.snapshot import (
    GroupTable,
    Layout,
    Owner,
    Snapshot,
    decode_runs,
    encode_runs,
)
from kvscope.rows import LayoutSnapshotRow
from kvscope_probe import wire

COLUMNS = ("ts, model, engine, session, step, num_blocks, free_blocks, cached_blocks, "
           "used_blocks, max_contiguous_free, budget_utilization, running, waiting, "
           "kv_group_kinds, states, block_group, owner, owner_req_ids, owner_blocks, "
           "owner_fragments, owner_group_runs, server")

StoreHistory = Callable[[str, float, float, int, int], list[Snapshot]]
"""``read(engine, t0, t1, limit, max_runs)``: at most ``limit`` snapshots, oldest first."""
CELLS_PER_READ = 262_144
"""Block entries one query of stored snapshots decodes at most (each row holds a few per
block of the pool): pages of ``CELLS_PER_READ // num_blocks`` rows, one row at least."""


def layout_rows(snap: Snapshot, *, arrays: bool = False) -> list[dict[str, Any]]:
    """Rows of ``layout_snapshots`` (clickhouse/schema/050_layout_snapshots.sql) for one
    snapshot: one row, as a list so a sink can extend its batch. ``states``,
    ``block_group`` (-1 shared) and ``owner`` have one entry per block; ``owner`` is
    1-based as ClickHouse arrays are: 0 none, i means ``owner_req_ids[i]``;
    ``owner_group_runs`` holds, per owner and group, its table's runs flattened (first,
    length, first, length, ...). ``ts`` is epoch
    seconds (float) as in ``kvscope.rows``; the writer makes it a DateTime64. ``arrays``:
    the three per-block columns stay numpy arrays, which ``kvscope.store.arrow`` encodes in
    one pass (the sidecar's path to its store; a 131,072-block row took 62 ms as lists)."""
    states, owner, group = decode_runs(snap.runs)
    owners = list(snap.owners)  # their tables are built when read: once
    out = (lambda a: a) if arrays else (lambda a: a.tolist())
    return [{
        "ts": snap.ts,
        "model": snap.model,
        "engine": snap.engine,
        "session": snap.session,
        "step": snap.step,
        "num_blocks": snap.num_blocks,
        "free_blocks": snap.free_blocks,
        "cached_blocks": snap.cached_blocks,
        "used_blocks": snap.used_blocks,
        "max_contiguous_free": snap.max_contiguous_free,
        "budget_utilization": (-1.0 if snap.budget_utilization is None
                               else float(snap.budget_utilization)),
        "running": snap.running,
        "waiting": snap.waiting,
        "kv_group_kinds": [g.kind for g in snap.kv_groups],
        "states": out(states),
        "block_group": out(group.astype(np.int8)),
        "owner": out((owner + 1).astype(np.uint32)),
        "owner_req_ids": [o.req_id for o in owners],
        "owner_blocks": [o.blocks for o in owners],
        "owner_fragments": [o.fragments for o in owners],
        "owner_group_runs": [[[x for r in t.runs for x in r] for t in o.groups]
                             for o in owners],
        "server": snap.server,
    }]


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
                    kv_groups=tuple(wire.KVGroup(k, 0) for k in kinds),
                    layout=Layout.of(runs, owners), free_blocks=int(free),
                    cached_blocks=int(cached),
                    used_blocks=int(used), max_contiguous_free=int(maxrun),
                    budget_utilization=None if util < 0 else float(util),
                    running=int(running), waiting=int(waiting), server=server)


def _group_tables(flat: list[list[int]]) -> tuple[GroupTable, ...]:
    """Per-group tables back from their flattened runs (first, length, ...)."""
    return tuple(GroupTable(tuple(zip(g[0::2], g[1::2], strict=True))) for g in flat)


def clickhouse_history(client: Callable[[], Any], database: str) -> StoreHistory:
    """A reader for layout_router: the newest snapshots of one engine (its
    EngineState.key) in [t0, t1], oldest first: ``limit`` at most, and no more once their
    runs pass ``max_runs`` (the answer's budget). Read newest first in pages of
    ``CELLS_PER_READ`` block entries: a week of a 131,072-block pool's samples is never
    decoded at once for an answer that keeps a few of them."""

    def read(engine: str, t0: float, t1: float, limit: int, max_runs: int) -> list[Snapshot]:
        out: list[Snapshot] = []
        runs, page, before = 0, 1, int(t1 * 1000) + 1
        t0_ms = int(t0 * 1000)
        while len(out) < limit and runs <= max_runs:
            want = min(page, limit - len(out))
            rows = client().query(
                f"SELECT {COLUMNS} FROM {database}.layout_snapshots "
                "WHERE if(server = '', engine, concat(server, '/', engine)) = {engine:String} "
                "AND ts >= fromUnixTimestamp64Milli({t0:Int64}, 'UTC') "
                "AND ts < fromUnixTimestamp64Milli({before:Int64}, 'UTC') "
                "ORDER BY ts DESC LIMIT {page:UInt32}",
                parameters={"engine": engine, "t0": t0_ms, "before": before,
                            "page": want}).result_rows
            for r in rows:
                snap = snapshot_from_row(r)
                out.append(snap)
                runs += snap.runs.shape[0]
                if runs > max_runs:
                    break
            if len(rows) < want:
                break
            before = round(out[-1].ts * 1000)
            page = max(1, CELLS_PER_READ // max(1, out[-1].num_blocks))
        out.reverse()
        return out

    return read
