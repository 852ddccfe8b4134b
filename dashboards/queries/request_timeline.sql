-- One request's story: every lifecycle event of request_id in order (queued, admitted,
-- allocated, preempted, resumed, finished, aborted), with the blocks it took or lost, the
-- pool's total / free blocks and longest free run at that moment, tokens, and the reason
-- of a preemption. An engine restart can reuse an ID: engine and step tell them apart.
-- @param request_id = ''   the engine's request ID (as in request_traces)
-- @param model = ''        one model ('' = all)
-- @param engine = ''       one engine ('' = all)
-- @param server = ''       one vLLM server ('' = all)
SELECT
    ts,
    server,
    engine,
    event,
    step,
    blocks,
    total_blocks,
    free_blocks,
    max_contiguous_free,
    tokens,
    reason,
    detail
FROM request_events_all
WHERE request_id = {request_id:String}
  AND ({model:String} = '' OR model = {model:String})
  AND ({engine:String} = '' OR engine = {engine:String})
  AND ({server:String} = '' OR server = {server:String})
ORDER BY ts, step, event
