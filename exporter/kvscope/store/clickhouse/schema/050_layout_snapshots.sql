-- Layout snapshots (layer 3): each engine's KV block pool as the sidecar's LayoutSampler
-- sampled it (once a second), one row per kept sample (kvscope.layout.store_cadence: once a
-- minute by default, both samples around a preemption, an unchanged pool once in 5 min).
-- Answers "what did the pool look like at time T": block ID x time heatmaps, which
-- request held a block, how scattered free blocks were. Per-block arrays hold one entry
-- per block ID (1-based: element i is block i - 1) and compress to almost nothing with
-- ZSTD because neighbouring blocks and consecutive samples repeat.
--   states       0 free, 1 cached (free, evictable prefix-cache data), 2 allocated, 3 null
--   block_group  KV cache group of an allocated block; -1 shared (free, cached, null)
--                when the engine has several groups; 0 everywhere with one group
--   owner        0 none, i = owner_req_ids[i] (the running request whose table lists it)
-- owner_group_runs[i][g] is owner i's block table in KV cache group g as runs of
-- consecutive block IDs, flattened: first, length, first, length, ...; first = 0 is a run
-- of null placeholders (entries a sliding-window or Mamba group no longer needs).
-- budget_utilization is -1 when unknown (sentinel, as in every kvscope table). ts is
-- the sidecar wall clock. Placeholders: {database}, {ttl_days}, {dedup_window}.
CREATE TABLE IF NOT EXISTS {database}.layout_snapshots
(
    ts DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model LowCardinality(String),
    engine LowCardinality(String),
    session LowCardinality(String),
    step UInt64 CODEC(Delta, ZSTD(1)),
    num_blocks UInt32,
    free_blocks UInt32,
    cached_blocks UInt32,
    used_blocks UInt32,
    max_contiguous_free UInt32,
    budget_utilization Float32,
    running UInt32,
    waiting UInt32,
    kv_group_kinds Array(LowCardinality(String)),
    states Array(UInt8) CODEC(ZSTD(3)),
    block_group Array(Int8) CODEC(ZSTD(3)),
    owner Array(UInt32) CODEC(ZSTD(3)),
    owner_req_ids Array(String) CODEC(ZSTD(3)),
    owner_blocks Array(UInt32) CODEC(ZSTD(3)),
    owner_fragments Array(UInt32) CODEC(ZSTD(3)),
    owner_group_runs Array(Array(Array(UInt32))) CODEC(ZSTD(3)),
    server LowCardinality(String) DEFAULT ''  -- vLLM server of the engine (070)
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (model, server, engine, ts)
TTL toDateTime(ts) + toIntervalDay({ttl_days})
SETTINGS non_replicated_deduplication_window = {dedup_window}, ttl_only_drop_parts = 1;

-- Tables created before owner_group_runs existed get it (empty for their old rows).
ALTER TABLE {database}.layout_snapshots
    ADD COLUMN IF NOT EXISTS owner_group_runs Array(Array(Array(UInt32))) CODEC(ZSTD(3));
