-- The requester of a preemption (the request whose allocation failed), as vLLM named it:
-- detail's "requester=<id> blocks_needed=<n>" is split on spaces, and a request ID may hold
-- spaces (vLLM takes a caller's X-Request-Id as sent). A table created before gets the
-- column here (new ones have it: the statement does nothing then); rows written before
-- read '' in it, and their readers parse detail as they did (kvscope.explain.story.requester).
-- Placeholders: {database}.
ALTER TABLE {database}.request_events ADD COLUMN IF NOT EXISTS requester String DEFAULT '' CODEC(ZSTD(1));
