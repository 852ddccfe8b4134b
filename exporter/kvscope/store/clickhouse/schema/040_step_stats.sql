-- Layer 1 at one-second grain: budget vs blocks per engine-second
-- (kvscope.rows.StepStat). Placeholders: {database}, {ttl_days}, {dedup_window}.
CREATE TABLE IF NOT EXISTS {database}.step_stats
(
    ts                      DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model                   LowCardinality(String),
    engine                  LowCardinality(String),
    steps                   Int64,
    scheduled_tokens        Int64,
    budget_tokens           Int64,
    min_free_blocks         Int32,
    avg_free_blocks         Float64,
    min_max_contiguous_free Int32,
    max_used_blocks         Int32,
    avg_running             Float64,
    max_waiting             Int32,
    preemptions             Int32,
    tail_waste_tokens       Int64,
    server LowCardinality(String) DEFAULT ''  -- vLLM server of the engine (070)
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (model, server, engine, ts)
TTL toDateTime(ts) + toIntervalDay({ttl_days})
SETTINGS non_replicated_deduplication_window = {dedup_window}, ttl_only_drop_parts = 1;
