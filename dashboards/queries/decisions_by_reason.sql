-- The decision log as ClickHouse stores it (scheduler_decisions): per decision kind
-- (preempt, admission_blocked, never_fits, resume, finish, abort, error) and reason over a time
-- range, how many, the requests involved, the average blocks needed and free at the
-- decision, and the lowest free count and max contiguous free run seen. Loki's counts of
-- the same log (loki/queries.logql) should agree.
-- @param model = ''    one model ('' = all)
-- @param engine = ''   one engine ('' = all)
-- @param server = ''   one vLLM server ('' = all)
SELECT
    decision,
    reason,
    count() AS decisions,
    uniqExact(request_id) AS requests,
    round(avgOrNullIf(blocks_needed, blocks_needed >= 0), 2) AS avg_blocks_needed,
    round(avgOrNullIf(free_blocks, free_blocks >= 0), 2) AS avg_free_blocks,
    minOrNullIf(free_blocks, free_blocks >= 0) AS min_free_blocks,
    minOrNullIf(max_contiguous_free, max_contiguous_free >= 0) AS min_max_contiguous_free
FROM scheduler_decisions
WHERE ts >= {since:DateTime64(3)}
  AND ts <= {until:DateTime64(3)}
  AND ({model:String} = '' OR model = {model:String})
  AND ({engine:String} = '' OR engine = {engine:String})
  AND ({server:String} = '' OR server = {server:String})
GROUP BY decision, reason
ORDER BY decisions DESC, decision, reason
