-- Which sidecar count a row's step is of (kvscope.rows.RequestEvent.step_counter, and
-- RequestAllocations' for its allocations' steps). The sidecar numbers an engine's steps
-- itself, from 1 when it takes up the engine's probe session: a sidecar restarted while
-- the engine runs takes the session up again from the probe's next keyframe and numbers
-- its steps from 1 again, under the same session and engine_configs row, so nothing else
-- in the store says where the steps went back. A table created before gets the column
-- here (new ones have it: the statements do nothing then); rows written before read '',
-- one count as far as a reader can tell. request_events_all (170) reads it.
-- Placeholders: {database}.
ALTER TABLE {database}.request_events ADD COLUMN IF NOT EXISTS step_counter LowCardinality(String) DEFAULT '';
ALTER TABLE {database}.request_allocations ADD COLUMN IF NOT EXISTS step_counter LowCardinality(String) DEFAULT '';
