-- What do preemptions cost in recomputation? Per model and engine over the last `days`
-- days: requests, preempted requests, preemptions, tokens computed a second time after a
-- resume (recomputed_tokens: discarded tokens minus prefix-cache hits on resume), their
-- share of the prompt + output tokens of the requests whose recomputation is known (-1,
-- unknown, for one preempted before the sidecar took the engine up: see request_traces),
-- the average and largest per preempted request,
-- and the mean end-to-end seconds of preempted vs never-preempted requests (of those whose
-- arrival the sidecar saw: -1 otherwise, see request_traces).
-- @param days = 7      window, in days back from now
-- @param model = ''    one model ('' = all)
-- @param engine = ''   one engine ('' = all)
-- @param server = ''   one vLLM server ('' = all)
SELECT
    model,
    server,
    engine,
    count() AS requests,
    countIf(preempt_count > 0) AS preempted_requests,
    sum(preempt_count) AS preemptions,
    sumIf(recomputed_tokens, recomputed_tokens >= 0) AS total_recomputed_tokens,
    sum(prompt_len + output_len) AS total_tokens,
    round(total_recomputed_tokens
          / nullIf(sumIf(prompt_len + output_len, recomputed_tokens >= 0), 0), 4)
        AS recomputed_ratio,
    round(avgOrNullIf(recomputed_tokens, preempt_count > 0 AND recomputed_tokens >= 0), 2)
        AS avg_recomputed_per_preempted,
    max(recomputed_tokens) AS max_recomputed_tokens,
    round(avgOrNullIf(e2e_seconds, preempt_count > 0 AND e2e_seconds >= 0), 3)
        AS avg_e2e_seconds_preempted,
    round(avgOrNullIf(e2e_seconds, preempt_count = 0 AND e2e_seconds >= 0), 3)
        AS avg_e2e_seconds_not_preempted
FROM request_traces
WHERE ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR model = {model:String})
  AND ({engine:String} = '' OR engine = {engine:String})
  AND ({server:String} = '' OR server = {server:String})
GROUP BY model, server, engine
ORDER BY total_recomputed_tokens DESC, model, server, engine
