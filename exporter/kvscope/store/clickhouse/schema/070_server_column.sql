-- Engine identity is (server, engine): the vLLM server (its API server's host:port, or
-- KVSCOPE_SERVER) and vLLM's engine label (the data-parallel index). Tables created before
-- kvscope recorded the server get the column here; new tables have it already (the
-- statements do nothing then). Rows written before carry server ''.
-- Placeholders: {database}.
ALTER TABLE {database}.request_traces ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.request_events ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.scheduler_decisions ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.step_stats ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.layout_snapshots ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
