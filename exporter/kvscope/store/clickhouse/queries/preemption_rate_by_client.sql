-- Which clients get preempted? Per client over the last `days` days: API requests
-- answered, how many of them had an engine request preempted at least once (an API
-- request of n > 1 samples counts once here; kvscope_client_preempted_requests_total counts
-- its engine requests), the preemption rate (preempted / joined API requests),
-- preemptions (of all their engine requests), duplicates, and p50 / p99
-- answer time. Rows come from client_requests (the vLLM middleware) joined by kvscope to
-- the engine's traces; requests never joined (preempt_count = -1) count as requests only.
-- @param days = 7      window, in days back from now
-- @param model = ''    one model ('' = all)
-- @param limit = 50    rows to return
SELECT
    if(client_id = '', if(api_key_hash = '', 'anonymous', concat('key:', substring(api_key_hash, 1, 8))), client_id) AS client,
    count() AS requests,
    countIf(preempt_count >= 0) AS joined,
    countIf(preempt_count > 0) AS preempted_requests,
    round(countIf(preempt_count > 0) / greatest(countIf(preempt_count >= 0), 1), 4) AS preemption_rate,
    sumIf(preempt_count, preempt_count > 0) AS preemptions,
    countIf(duplicate) AS duplicates,
    round(quantile(0.5)(duration_s), 3) AS p50_seconds,
    round(quantile(0.99)(duration_s), 3) AS p99_seconds
FROM client_requests
WHERE ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR model = {model:String})
GROUP BY client
ORDER BY preemption_rate DESC, requests DESC, client
LIMIT {limit:UInt32}
