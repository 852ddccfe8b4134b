-- Which requests were preempted most over the last `days` days, and what did it cost
-- them? One row per request (most preemptions first, then most recomputed tokens): its
-- size, its blocks, its last preemption reason, the tokens computed twice, its queue and
-- end-to-end times, and the client that sent it.
-- @param days = 7      window, in days back from now
-- @param limit = 20    rows to return
-- @param model = ''    one model ('' = all)
-- @param engine = ''   one engine ('' = all)
-- @param server = ''   one vLLM server ('' = all)
SELECT
    ts AS ended,
    model,
    server,
    engine,
    request_id,
    preempt_count,
    preempt_reason,
    recomputed_tokens,
    prompt_len,
    output_len,
    required_blocks,
    allocated_blocks,
    block_fragments,
    queue_seconds,
    e2e_seconds,
    finish_reason,
    client_id
FROM request_traces
WHERE preempt_count > 0
  AND ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR model = {model:String})
  AND ({engine:String} = '' OR engine = {engine:String})
  AND ({server:String} = '' OR server = {server:String})
ORDER BY preempt_count DESC, recomputed_tokens DESC, ended, request_id
LIMIT {limit:UInt32}
