-- Layer 4 in ClickHouse: preempt, admission_blocked, never_fits, resume, finish and abort decisions
-- with the facts that let anyone check the cause (kvscope.rows.SchedulerDecision).
-- Placeholders: {database}, {ttl_days}, {dedup_window}.
-- kvscope:sharding_key cityHash64(request_id)
CREATE TABLE IF NOT EXISTS {database}.scheduler_decisions
(
    ts                  DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model               LowCardinality(String),
    engine              LowCardinality(String),
    decision            LowCardinality(String),
    request_id          String CODEC(ZSTD(1)),
    reason              LowCardinality(String),
    blocks_needed       Int32,
    free_blocks         Int32,
    max_contiguous_free Int32,
    tokens              Int64,
    policy              LowCardinality(String),
    msg                 String CODEC(ZSTD(1)),
    server LowCardinality(String) DEFAULT ''  -- vLLM server of the engine (070)
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (model, server, engine, decision, ts)
TTL toDateTime(ts) + toIntervalDay({ttl_days})
SETTINGS non_replicated_deduplication_window = {dedup_window}, ttl_only_drop_parts = 1;
