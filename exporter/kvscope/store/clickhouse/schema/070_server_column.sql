-- Engine identity is (server, engine): the vLLM server (its API server's host:port, or
-- KVSCOPE_SERVER) and vLLM's engine label (the data-parallel index). Tables created before
-- kvscope recorded the server get the column here; new tables have it already (the
-- statements do nothing then). Rows written before carry server ''.
-- New tables sort by (model, server, engine, ...), so one server's rows are a narrow range
-- (tests/clickhouse/test_fleet_keys.py); a sorting key cannot take an existing column, so
-- tables created before keep (model, engine, ...) and a one-server read there scans every
-- server of that model (re-key by CREATE TABLE ... AS SELECT into a new table to change it).
-- Placeholders: {database}.
ALTER TABLE {database}.request_traces ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.request_events ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.scheduler_decisions ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.step_stats ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.layout_snapshots ADD COLUMN IF NOT EXISTS server LowCardinality(String) DEFAULT '';
