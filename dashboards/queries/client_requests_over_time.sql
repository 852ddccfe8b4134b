-- API requests, preempted ones and duplicate submissions per client over a time range, in
-- buckets of bucket_s seconds: a retry storm shows as duplicates rising with preemptions.
-- @param model = ''      one model ('' = all)
-- @param bucket_s = 60   seconds per bucket
SELECT
    toStartOfInterval(ts, toIntervalSecond({bucket_s:UInt32})) AS time,
    client_id,
    count() AS requests,
    countIf(preempt_count > 0) AS preempted,
    countIf(duplicate) AS duplicates
FROM client_requests
WHERE ts >= {since:DateTime64(3)}
  AND ts <= {until:DateTime64(3)}
  AND ({model:String} = '' OR model = {model:String})
GROUP BY time, client_id
ORDER BY time, client_id
