-- Layer 5: one row per API request the middleware saw answered, joined to the engine's
-- request IDs (kvscope.rows.ClientRequest). No engine column: one API request may
-- fan out to several engine requests (engine_ids; engine_request_ids is the same list
-- comma-joined, for readers before 130). ts is the API server's clock.
-- Placeholders: {database}, {ttl_days}, {dedup_window}.
-- kvscope:sharding_key cityHash64(request_id)
CREATE TABLE IF NOT EXISTS {database}.client_requests
(
    ts                 DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
    request_id         String CODEC(ZSTD(1)),
    engine_request_ids String CODEC(ZSTD(1)),
    model              LowCardinality(String),
    endpoint           LowCardinality(String),
    client_id          LowCardinality(String),
    user_agent         LowCardinality(String),
    api_key_hash       LowCardinality(String),
    prompt_hash        String CODEC(ZSTD(1)),
    prompt_chars       Int32,
    max_tokens         Int32,
    http_status        Int32,
    duration_s         Float64,
    duplicate          Bool,
    duplicate_of       String CODEC(ZSTD(1)),
    preempt_count      Int32,
    preempt_reason     LowCardinality(String),
    engine_ids         Array(String) DEFAULT [] CODEC(ZSTD(1))  -- (130)
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (model, client_id, ts, request_id)
TTL toDateTime(ts) + toIntervalDay({ttl_days})
SETTINGS non_replicated_deduplication_window = {dedup_window}, ttl_only_drop_parts = 1;
