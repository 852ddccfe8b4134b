-- Layer 2, compactly: a request's block allocations (the "allocated" events), one row per
-- request per run of them (kvscope.rows.RequestAllocations). With 16-token blocks a
-- decoding request grows a block every 16 steps, so at 256 running ~16 requests allocate
-- every step: one request_events row each was ~95% of all rows written. The tracker
-- collects a request's allocations and writes them as one row of arrays when the request
-- is preempted or ends, and for every request still growing every 5 s of engine time
-- (kvscope.state.request_allocations.FLUSH_EVERY_S: as long as the store gathers rows).
-- Element i of each array is one allocation: the engine step, its time as milliseconds
-- after ts, the blocks added, the blocks held after it, the pool's free blocks and the
-- request's computed tokens then. request_events_all (170) reads them back as one
-- request_events row each, exactly as they were written before.
-- Placeholders: {database}, {ttl_days}, {dedup_window}.
-- kvscope:sharding_key cityHash64(request_id)
CREATE TABLE IF NOT EXISTS {database}.request_allocations
(
    ts           DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model        LowCardinality(String),
    engine       LowCardinality(String),
    request_id   String CODEC(ZSTD(1)),
    step         Array(Int64) CODEC(ZSTD(1)),
    offset_ms    Array(UInt32) CODEC(ZSTD(1)),
    blocks       Array(Int32) CODEC(ZSTD(1)),
    total_blocks Array(Int32) CODEC(ZSTD(1)),
    free_blocks  Array(Int32) CODEC(ZSTD(1)),
    tokens       Array(Int64) CODEC(ZSTD(1)),
    server       LowCardinality(String),
    step_counter LowCardinality(String) DEFAULT ''  -- the sidecar count of step (160)
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (model, server, engine, request_id, ts)
TTL toDateTime(ts) + toIntervalDay({ttl_days})
SETTINGS non_replicated_deduplication_window = {dedup_window}, ttl_only_drop_parts = 1;
