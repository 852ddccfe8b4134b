-- Tail waste by prompt length: how many token slots do requests reserve but never fill?
-- Per prompt-length bucket (power-of-two upper bound, prompt_len_le) over the last `days`
-- days, for requests that held blocks: the slack in the last block of the finished
-- sequence (required_blocks x block_size - tokens) and against the most blocks the
-- request held at once (allocated_blocks x block_size - tokens; it can dip below zero by
-- the final token, whose KV is never written), with waste_ratio = required-basis waste /
-- slots. Each request is measured in its engine's own block size: the engine_configs row
-- of its engine at or before the request ended. Only engines of one full-attention KV
-- cache group are measured: with more than one group (a hybrid model) a trace's blocks sum
-- groups whose blocks hold different spans; a sliding-window group holds the window's
-- blocks and a Mamba group one state, not the sequence's; an engine without a stored
-- configuration cannot be measured either.
-- @param days = 7          window, in days back from now
-- @param model = ''        one model ('' = all)
-- @param engine = ''       one engine ('' = all)
-- @param server = ''       one vLLM server ('' = all)
SELECT
    if(t.prompt_len <= 1, 1, toUInt64(exp2(ceil(log2(t.prompt_len))))) AS prompt_len_le,
    count() AS requests,
    sum(t.prompt_len + t.output_len) AS tokens,
    sum(toInt64(t.required_blocks) * c.block_size) - tokens AS tail_waste_tokens,
    round(tail_waste_tokens / requests, 2) AS avg_tail_waste_tokens,
    round(tail_waste_tokens / sum(toInt64(t.required_blocks) * c.block_size), 4) AS waste_ratio,
    sum(toInt64(t.allocated_blocks) * c.block_size) - tokens AS allocated_waste_tokens,
    round(allocated_waste_tokens / requests, 2) AS avg_allocated_waste_tokens
FROM request_traces AS t
ASOF INNER JOIN engine_configs AS c
    ON t.model = c.model AND t.server = c.server AND t.engine = c.engine AND t.ts >= c.ts
WHERE t.allocated_blocks > 0
  AND t.required_blocks > 0
  AND c.kv_group_kinds IN (['FullAttentionSpec'], ['MLAAttentionSpec'])
  AND c.block_size > 0
  AND t.ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR t.model = {model:String})
  AND ({engine:String} = '' OR t.engine = {engine:String})
  AND ({server:String} = '' OR t.server = {server:String})
GROUP BY prompt_len_le
ORDER BY prompt_len_le
