-- Which user agents (SDKs, versions, scripts) get preempted? Same figures as
-- preemption_rate_by_client, per User-Agent header over the last `days` days.
-- @param days = 7      window, in days back from now
-- @param model = ''    one model ('' = all)
-- @param limit = 50    rows to return
SELECT
    if(user_agent = '', '(none)', user_agent) AS agent,
    count() AS requests,
    countIf(preempt_count >= 0) AS joined,
    countIf(preempt_count > 0) AS preempted_requests,
    round(countIf(preempt_count > 0) / greatest(countIf(preempt_count >= 0), 1), 4) AS preemption_rate,
    sumIf(preempt_count, preempt_count > 0) AS preemptions,
    countIf(duplicate) AS duplicates
FROM client_requests
WHERE ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR model = {model:String})
GROUP BY agent
ORDER BY preemption_rate DESC, requests DESC, agent
LIMIT {limit:UInt32}
