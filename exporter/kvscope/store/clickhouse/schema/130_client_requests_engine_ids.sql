-- The engine request IDs of an API request, each as vLLM named it: vLLM takes a caller's
-- X-Request-Id as sent, commas included, and engine IDs embed it, so the comma-joined
-- engine_request_ids cannot be split back (kvscope explain read "cmpl-a" and " b-0-..." for
-- the caller's "a, b"). A table created before gets the column here (new ones have it: the
-- statement does nothing then); rows written before read [] in it, and their readers split
-- engine_request_ids on ',' as they did (kvscope.explain.source.engine_ids).
-- Placeholders: {database}.
ALTER TABLE {database}.client_requests ADD COLUMN IF NOT EXISTS engine_ids Array(String) DEFAULT [] CODEC(ZSTD(1));
