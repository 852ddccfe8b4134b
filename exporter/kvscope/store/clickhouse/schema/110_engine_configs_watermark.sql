-- The blocks vLLM's --watermark keeps from waiting and preempted requests while any
-- request runs, so a replay of an engine's traffic holds them back as the engine did. A
-- table created before gets the column here (new ones have it: the statement does
-- nothing then); rows written before read 0, as their replays ran.
-- Placeholders: {database}.
ALTER TABLE {database}.engine_configs ADD COLUMN IF NOT EXISTS watermark_blocks Int64 DEFAULT 0;
