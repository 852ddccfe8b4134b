-- Hourly preemption rate over the last `days` days, the classic question: per hour (UTC),
-- requests that ended, how many were preempted at least once (preemption_rate = the
-- share of them), preemptions, the average blocks the failed allocation needed, and the
-- lowest max-contiguous-free run seen at a preemption (scheduler_decisions) and at the
-- admission of the requests that ended in the hour (request_traces: a request's row is
-- written at its end, so its admission's run falls in the hour it ended). Hours with
-- neither requests nor preemptions are absent.
-- On vLLM V1 a short contiguous run never causes a preemption by itself: compare free
-- blocks with blocks needed in blocks_needed_vs_free.sql.
-- @param days = 7      window, in days back from now
-- @param model = ''    one model ('' = all)
-- @param engine = ''   one engine ('' = all)
-- @param server = ''   one vLLM server ('' = all)
WITH
    traces AS
    (
        SELECT
            toStartOfHour(ts) AS hour,
            count() AS requests,
            countIf(preempt_count > 0) AS preempted_requests,
            minOrNullIf(max_contiguous_free_blocks_at_alloc,
                        max_contiguous_free_blocks_at_alloc >= 0) AS min_contiguous_at_admission
        FROM request_traces
        WHERE ts >= now() - toIntervalDay({days:UInt32})
          AND ({model:String} = '' OR model = {model:String})
          AND ({engine:String} = '' OR engine = {engine:String})
          AND ({server:String} = '' OR server = {server:String})
        GROUP BY hour
    ),
    preempts AS
    (
        SELECT
            toStartOfHour(ts) AS hour,
            count() AS preemptions,
            avgOrNullIf(blocks_needed, blocks_needed >= 0) AS avg_blocks_needed,
            minOrNullIf(max_contiguous_free, max_contiguous_free >= 0) AS min_contiguous_at_preemption
        FROM scheduler_decisions
        WHERE decision = 'preempt'
          AND ts >= now() - toIntervalDay({days:UInt32})
          AND ({model:String} = '' OR model = {model:String})
          AND ({engine:String} = '' OR engine = {engine:String})
          AND ({server:String} = '' OR server = {server:String})
        GROUP BY hour
    )
SELECT
    hour,
    requests,
    preempted_requests,
    if(requests = 0, NULL, round(preempted_requests / requests, 4)) AS preemption_rate,
    preemptions,
    round(avg_blocks_needed, 2) AS avg_blocks_needed,
    min_contiguous_at_preemption,
    min_contiguous_at_admission
FROM traces
FULL OUTER JOIN preempts USING (hour)
ORDER BY hour
