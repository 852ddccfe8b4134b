-- One request's trace row: its size, the blocks it needed and got (and in how many
-- fragments), how often and why it was preempted, the tokens computed twice, the pool at
-- its admission, its queue / first-token / end-to-end times and the client that sent it.
-- @param request_id = ''   the engine's request ID
-- @param model = ''        one model ('' = all)
-- @param engine = ''       one engine ('' = all)
-- @param server = ''       one vLLM server ('' = all)
SELECT
    ts AS ended,
    model,
    server,
    engine,
    request_id,
    prompt_len,
    max_gen_len,
    output_len,
    required_blocks,
    allocated_blocks,
    block_fragments,
    contiguous_allocated,
    preempt_count,
    preempt_reason,
    recomputed_tokens,
    cached_tokens,
    free_blocks_at_alloc,
    max_contiguous_free_blocks_at_alloc,
    queue_seconds,
    first_token_seconds,
    e2e_seconds,
    finish_reason,
    client_id,
    user_agent
FROM request_traces
WHERE request_id = {request_id:String}
  AND ({model:String} = '' OR model = {model:String})
  AND ({engine:String} = '' OR engine = {engine:String})
  AND ({server:String} = '' OR server = {server:String})
ORDER BY ended
