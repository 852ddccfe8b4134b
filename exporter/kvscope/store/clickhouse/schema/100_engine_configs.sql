-- Each engine's settings, a row per probe session (kvscope.rows.EngineConfig), as its
-- hello states them: the pool, the KV cache groups, the scheduler's limits and kind. A
-- replay of the engine's traffic is rebuilt from this row alone (kvscope explain
-- --counterfactual with no settings). A sidecar that restarts writes the row of a session
-- it already wrote again, and writes it again every hour of the engine's time, so the TTL
-- never leaves a running engine without one; readers take the latest row at or before the
-- time they ask for.
-- Placeholders: {database}, {ttl_days}, {dedup_window}.
CREATE TABLE IF NOT EXISTS {database}.engine_configs
(
    ts                     DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model                  LowCardinality(String),
    engine                 LowCardinality(String),
    session                String,
    vllm_version           LowCardinality(String),
    num_blocks             Int64,
    block_size             Int32,
    kv_group_kinds         Array(LowCardinality(String)),
    kv_group_block_sizes   Array(Int32),
    kv_group_windows       Array(Int32),
    token_budget           Int64,
    max_num_batched_tokens Int64,
    max_num_seqs           Int32,
    max_model_len          Int64,
    policy                 LowCardinality(String),
    prefix_caching         Bool,
    async_scheduling       Bool,
    spec_tokens            Int32,
    server                 LowCardinality(String),
    watermark_blocks       Int64
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (model, server, engine, ts)
TTL toDateTime(ts) + toIntervalDay({ttl_days})
SETTINGS non_replicated_deduplication_window = {dedup_window}, ttl_only_drop_parts = 1;
