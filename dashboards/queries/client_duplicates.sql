-- Duplicate submissions: which clients sent the same prompt again within seconds (the
-- middleware's duplicate window), and how often? Per client and prompt hash over the last
-- `days` days: submissions, how many were flagged duplicates, the first and last, the
-- seconds between them, and how many of them were preempted. A burst here is a retry storm.
-- @param days = 7      window, in days back from now
-- @param model = ''    one model ('' = all)
-- @param limit = 20    rows to return
SELECT
    client_id,
    prompt_hash,
    count() AS submissions,
    countIf(duplicate) AS duplicates,
    min(ts) AS first,
    max(ts) AS last,
    round(dateDiff('millisecond', first, last) / 1000, 3) AS span_s,
    countIf(preempt_count > 0) AS preempted,
    any(user_agent) AS user_agent
FROM client_requests
WHERE ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR model = {model:String})
  AND prompt_hash != ''
GROUP BY client_id, prompt_hash
HAVING duplicates > 0
ORDER BY duplicates DESC, submissions DESC, last DESC
LIMIT {limit:UInt32}
