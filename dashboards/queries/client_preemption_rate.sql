-- Which clients and user agents get preempted? Per client ID and User-Agent over the
-- last `days` days (client_requests, one row per API request the middleware saw
-- answered): requests, those joined to engine traces, those preempted at least once
-- (preemption_rate = their share of the joined ones), preemptions, duplicate submissions
-- and the share of non-2xx answers.
-- @param days = 7      window, in days back from now
-- @param model = ''    one model ('' = all)
SELECT
    client_id,
    user_agent,
    count() AS requests,
    countIf(preempt_count >= 0) AS joined,
    countIf(preempt_count > 0) AS preempted_requests,
    round(preempted_requests / nullIf(joined, 0), 4) AS preemption_rate,
    sumIf(preempt_count, preempt_count > 0) AS preemptions,
    countIf(duplicate) AS duplicates,
    round(countIf(http_status < 200 OR http_status >= 300) / requests, 4) AS error_rate,
    round(avg(duration_s), 3) AS avg_duration_s
FROM client_requests
WHERE ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR model = {model:String})
GROUP BY client_id, user_agent
ORDER BY preemption_rate DESC, requests DESC, client_id, user_agent
