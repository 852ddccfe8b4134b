-- Tail waste by prompt length: how many token slots do requests reserve but never fill?
-- Per prompt-length bucket (power-of-two upper bound, prompt_len_le) over the last `days`
-- days, for requests that held blocks: the slack in the last block of the finished
-- sequence (required_blocks x block_size - tokens) and against the most blocks the
-- request held at once (allocated_blocks x block_size - tokens; it can dip below zero by
-- the final token, whose KV is never written), with waste_ratio = required-basis waste /
-- slots. Rows carry no block size: pass the engine's --block-size (one KV cache group).
-- @param days = 7          window, in days back from now
-- @param block_size = 16   tokens per KV block of the engine (vLLM --block-size)
-- @param model = ''        one model ('' = all)
-- @param engine = ''       one engine ('' = all)
-- @param server = ''       one vLLM server ('' = all)
SELECT
    if(prompt_len <= 1, 1, toUInt64(exp2(ceil(log2(prompt_len))))) AS prompt_len_le,
    count() AS requests,
    sum(prompt_len + output_len) AS tokens,
    sum(required_blocks) * {block_size:UInt32} - tokens AS tail_waste_tokens,
    round(tail_waste_tokens / requests, 2) AS avg_tail_waste_tokens,
    round(tail_waste_tokens / (sum(required_blocks) * {block_size:UInt32}), 4) AS waste_ratio,
    sum(allocated_blocks) * {block_size:UInt32} - tokens AS allocated_waste_tokens,
    round(allocated_waste_tokens / requests, 2) AS avg_allocated_waste_tokens
FROM request_traces
WHERE allocated_blocks > 0
  AND required_blocks > 0
  AND ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR model = {model:String})
  AND ({engine:String} = '' OR engine = {engine:String})
  AND ({server:String} = '' OR server = {server:String})
GROUP BY prompt_len_le
ORDER BY prompt_len_le
