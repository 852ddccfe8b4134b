-- How many of a table's latest inserts ClickHouse remembers by dedup token, so that a
-- batch sent again (its answer lost, or replayed from a restarted sidecar's spool) is
-- stored once. Tables created before kvscope sized it for a fleet kept 1000, about 40 s of
-- a table's inserts from 125 sidecars: a later retry was stored twice and every count in
-- it doubled. New tables have the window already (the statements change nothing then);
-- every apply sets it again, so the value here is the one in force. The arithmetic and the
-- memory it costs: clickhouse/README.md, "Dedup window". A cluster's replicated tables
-- use replicated_deduplication_window instead (the statements only reach their local
-- tables and change nothing there).
-- Placeholders: {database}, {dedup_window}.
ALTER TABLE {database}.request_traces MODIFY SETTING non_replicated_deduplication_window = {dedup_window};
ALTER TABLE {database}.request_events MODIFY SETTING non_replicated_deduplication_window = {dedup_window};
ALTER TABLE {database}.scheduler_decisions MODIFY SETTING non_replicated_deduplication_window = {dedup_window};
ALTER TABLE {database}.step_stats MODIFY SETTING non_replicated_deduplication_window = {dedup_window};
ALTER TABLE {database}.layout_snapshots MODIFY SETTING non_replicated_deduplication_window = {dedup_window};
ALTER TABLE {database}.client_requests MODIFY SETTING non_replicated_deduplication_window = {dedup_window};
ALTER TABLE {database}.request_allocations MODIFY SETTING non_replicated_deduplication_window = {dedup_window};
ALTER TABLE {database}.engine_configs MODIFY SETTING non_replicated_deduplication_window = {dedup_window};
