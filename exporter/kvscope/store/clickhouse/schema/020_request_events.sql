-- Layer 2: one row per lifecycle event of a request: queued, admitted, allocated,
-- preempted, resumed, finished, aborted (kvscope.rows.RequestEvent).
-- Placeholders: {database}, {ttl_days}, {dedup_window}. Ordered by request so one
-- request's story is a narrow range read.
-- kvscope:sharding_key cityHash64(request_id)
CREATE TABLE IF NOT EXISTS {database}.request_events
(
    ts                  DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model               LowCardinality(String),
    engine              LowCardinality(String),
    request_id          String CODEC(ZSTD(1)),
    event               LowCardinality(String),
    step                Int64,
    blocks              Int32,
    total_blocks        Int32,
    free_blocks         Int32,
    max_contiguous_free Int32,
    tokens              Int64,
    reason              LowCardinality(String),
    detail              String CODEC(ZSTD(1)),
    server LowCardinality(String) DEFAULT '',  -- vLLM server of the engine (070)
    requester String DEFAULT '' CODEC(ZSTD(1)),  -- preempted: who needed the blocks (140)
    step_counter LowCardinality(String) DEFAULT ''  -- the sidecar count of step (160)
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (model, server, engine, request_id, ts, event)
TTL toDateTime(ts) + toIntervalDay({ttl_days})
SETTINGS non_replicated_deduplication_window = {dedup_window}, ttl_only_drop_parts = 1;
