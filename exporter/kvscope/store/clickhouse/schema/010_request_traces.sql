-- Layer 2: one row per request when it ends (kvscope.rows.RequestTrace).
-- Placeholders: {database}, {ttl_days}, {dedup_window}. Sentinels, not NULL: -1 unknown
-- count or time, '' unknown string. Times are the engine's clock, stored in milliseconds (UTC).
-- kvscope:sharding_key cityHash64(request_id)
CREATE TABLE IF NOT EXISTS {database}.request_traces
(
    ts                                  DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    model                               LowCardinality(String),
    engine                              LowCardinality(String),
    request_id                          String CODEC(ZSTD(1)),
    prompt_len                          Int32,
    max_gen_len                         Int32,
    output_len                          Int32,
    required_blocks                     Int32,
    allocated_blocks                    Int32,
    contiguous_allocated                Bool,
    block_fragments                     Int32,
    preempt_count                       Int32,
    preempt_reason                      LowCardinality(String),
    recomputed_tokens                   Int64,
    cached_tokens                       Int64,
    free_blocks_at_alloc                Int32,
    max_contiguous_free_blocks_at_alloc Int32,
    arrival_ts                          DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    queue_seconds                       Float64,
    first_token_seconds                 Float64,
    e2e_seconds                         Float64,
    finish_reason                       LowCardinality(String),
    client_id                           LowCardinality(String),
    user_agent                          LowCardinality(String),
    api_key_hash                        LowCardinality(String),
    prompt_hash                         String CODEC(ZSTD(1)),
    server LowCardinality(String) DEFAULT ''  -- vLLM server of the engine (070)
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (model, server, engine, ts, request_id)
TTL toDateTime(ts) + toIntervalDay({ttl_days})
SETTINGS non_replicated_deduplication_window = {dedup_window}, ttl_only_drop_parts = 1;
