-- Duplicate submissions: the same client sending the same prompt (same prompt hash;
-- kvscope never stores the prompt) again within `window_s` seconds. One row per group of
-- repeats: how many times, over how long, and whether the earlier copies were preempted
-- (a client retrying a slow, preempted request makes the pool's pressure worse).
-- @param days = 1        window, in days back from now
-- @param window_s = 10   seconds between two submissions that make them duplicates
-- @param limit = 50      rows to return
SELECT
    client_id,
    prompt_hash,
    count() AS submissions,
    min(ts) AS first_seen,
    max(ts) AS last_seen,
    round(dateDiff('millisecond', min(ts), max(ts)) / 1000, 3) AS span_seconds,
    sumIf(preempt_count, preempt_count > 0) AS preemptions,
    groupArray(10)(request_id) AS request_ids
FROM
(
    SELECT
        ts, client_id, prompt_hash, request_id, preempt_count,
        dateDiff('millisecond',
                 lagInFrame(ts, 1, ts) OVER (PARTITION BY client_id, prompt_hash ORDER BY ts
                                              ROWS BETWEEN 1 PRECEDING AND CURRENT ROW),
                 ts) / 1000 AS since_previous,
        row_number() OVER (PARTITION BY client_id, prompt_hash ORDER BY ts) AS n
    FROM client_requests
    WHERE ts >= now() - toIntervalDay({days:UInt32}) AND prompt_hash != ''
)
GROUP BY client_id, prompt_hash
HAVING countIf(n > 1 AND since_previous <= {window_s:Float64}) > 0
ORDER BY submissions DESC, client_id, prompt_hash
LIMIT {limit:UInt32}
