-- Duplicate submissions: one client sending the same prompt (same prompt hash; kvscope
-- never stores the prompt) again within `window_s` seconds of the previous copy's
-- submission. The client is told apart as the sidecar's duplicate counter tells it: its
-- client ID, else its API key's hash, else anonymous (all callers with neither). A copy's
-- submission is its answer's time less its duration. One row per group of repeats (copies
-- each within `window_s` of the one before): how many, over how long from the first
-- submission to the last, and whether they were preempted (a client retrying a slow,
-- preempted request makes the pool's pressure worse).
-- @param days = 1        window, in days back from now
-- @param window_s = 10   seconds between two submissions that make them duplicates
-- @param limit = 50      rows to return
SELECT
    client,
    prompt_hash,
    count() AS submissions,
    min(submitted) AS first_seen,
    max(submitted) AS last_seen,
    round(dateDiff('millisecond', min(submitted), max(submitted)) / 1000, 3) AS span_seconds,
    sumIf(preempt_count, preempt_count > 0) AS preemptions,
    groupArray(10)(request_id) AS request_ids
FROM
(
    SELECT
        client, prompt_hash, request_id, preempt_count, submitted,
        sum(starts_group) OVER (PARTITION BY client, prompt_hash ORDER BY submitted, request_id
                                ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS repeats
    FROM
    (
        SELECT
            client, prompt_hash, request_id, preempt_count, submitted,
            (row_number() OVER w) = 1 OR dateDiff('millisecond',
                lagInFrame(submitted, 1, submitted) OVER (w ROWS BETWEEN 1 PRECEDING AND CURRENT ROW),
                submitted) / 1000 > {window_s:Float64} AS starts_group
        FROM
        (
            SELECT
                if(client_id != '', client_id, if(api_key_hash != '',
                   concat('key:', substring(api_key_hash, 1, 8)), 'anonymous')) AS client,
                prompt_hash, request_id, preempt_count,
                ts - toIntervalMillisecond(toInt64(greatest(duration_s, 0) * 1000)) AS submitted
            FROM client_requests
            WHERE ts >= now() - toIntervalDay({days:UInt32}) AND prompt_hash != ''
        )
        WINDOW w AS (PARTITION BY client, prompt_hash ORDER BY submitted, request_id)
    )
)
GROUP BY client, prompt_hash, repeats
HAVING count() > 1
ORDER BY submissions DESC, client, prompt_hash, first_seen
LIMIT {limit:UInt32}
