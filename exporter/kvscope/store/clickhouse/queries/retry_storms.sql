-- Retry storms: minutes in which a client's duplicate submissions or overload answers
-- (HTTP 429 / 503 / 504) reach `min_events`. A storm usually follows preemptions:
-- clients time out on slow, preempted requests and send them again, adding load to a
-- pool that is already full. One row per client-minute, worst first.
-- @param days = 1         window, in days back from now
-- @param min_events = 5   duplicates + overload answers in a minute that make a storm
-- @param limit = 50       rows to return
SELECT
    toStartOfMinute(ts) AS minute,
    if(client_id = '', 'anonymous', client_id) AS client,
    count() AS requests,
    countIf(duplicate) AS duplicates,
    countIf(http_status IN (429, 503, 504)) AS overload_answers,
    sumIf(preempt_count, preempt_count > 0) AS preemptions
FROM client_requests
WHERE ts >= now() - toIntervalDay({days:UInt32})
GROUP BY minute, client
HAVING duplicates + overload_answers >= {min_events:UInt32}
ORDER BY duplicates + overload_answers DESC, minute, client
LIMIT {limit:UInt32}
