-- Blocks needed vs free blocks at each preemption: does contiguity ever matter?
-- Per preemption reason over the last `days` days: preemptions whose failed allocation
-- needed more blocks than were free (free_lt_needed: a plain shortage) and those where
-- enough blocks were free (free_ge_needed); of the latter, those where no free run was
-- long enough (enough_free_no_run: only there could a contiguous allocator have failed
-- where vLLM's did not). On vLLM V1, kv_full preemptions should all be free_lt_needed;
-- with_facts counts preemptions whose blocks_needed and free_blocks are known.
-- @param days = 7      window, in days back from now
-- @param model = ''    one model ('' = all)
-- @param engine = ''   one engine ('' = all)
-- @param server = ''   one vLLM server ('' = all)
SELECT
    reason,
    count() AS preemptions,
    countIf(blocks_needed >= 0 AND free_blocks >= 0) AS with_facts,
    countIf(blocks_needed >= 0 AND free_blocks >= 0 AND free_blocks < blocks_needed) AS free_lt_needed,
    countIf(blocks_needed >= 0 AND free_blocks >= blocks_needed) AS free_ge_needed,
    countIf(blocks_needed >= 0 AND free_blocks >= blocks_needed
            AND max_contiguous_free >= 0 AND max_contiguous_free < blocks_needed) AS enough_free_no_run,
    round(avgOrNullIf(blocks_needed, blocks_needed >= 0), 2) AS avg_blocks_needed,
    round(avgOrNullIf(free_blocks, free_blocks >= 0), 2) AS avg_free_blocks,
    minOrNullIf(max_contiguous_free, max_contiguous_free >= 0) AS min_max_contiguous_free
FROM scheduler_decisions
WHERE decision = 'preempt'
  AND ts >= now() - toIntervalDay({days:UInt32})
  AND ({model:String} = '' OR model = {model:String})
  AND ({engine:String} = '' OR engine = {engine:String})
  AND ({server:String} = '' OR server = {server:String})
GROUP BY reason
ORDER BY preemptions DESC, reason
