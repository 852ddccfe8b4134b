-- Every lifecycle event of every request, one row each, as request_events held them before
-- allocations moved to request_allocations (080): the lifecycle rows as stored, plus each
-- allocation unrolled (event 'allocated', max_contiguous_free -1, no reason, detail or
-- requester). Rows written by older kvscope versions ('allocated' rows inside
-- request_events) are read as they are. Saved queries, dashboards and `kvscope explain`
-- read this view. It comes after every file that adds a column it reads (140: requester,
-- 160: step_counter), so a store created before gets the view once those columns are
-- there (it was 090, then 150).
-- Placeholders: {database}.
CREATE OR REPLACE VIEW {database}.request_events_all AS
SELECT ts, model, engine, request_id, event, step, blocks, total_blocks, free_blocks,
       max_contiguous_free, tokens, reason, detail, server, requester, step_counter
FROM {database}.request_events
UNION ALL
SELECT addMilliseconds(ts, offset_ms) AS ts, model, engine, request_id,
       toLowCardinality('allocated') AS event, step, blocks, total_blocks, free_blocks,
       toInt32(-1) AS max_contiguous_free, tokens, toLowCardinality('') AS reason,
       '' AS detail, server, '' AS requester, step_counter
FROM {database}.request_allocations
ARRAY JOIN step, offset_ms, blocks, total_blocks, free_blocks, tokens;
