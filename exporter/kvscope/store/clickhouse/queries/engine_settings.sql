-- Each engine's settings as its probe reported them when it attached (one row per probe
-- session, newest first; the sidecar writes a session's row again every hour, and
-- `attached` is its first): the pool (blocks with the null block, block size), its KV cache
-- groups (kind, block size, sliding window), the scheduler's limits (max_num_seqs, token
-- budget, max_model_len), policy, prefix caching, AsyncScheduler or not, speculative
-- tokens, the blocks `--watermark` holds back (0: none), vLLM's version. `kvscope explain ID --counterfactual engine` replays a request's
-- window under the row its engine had then, with nothing typed by hand.
-- @param model = ''   one model ('' = all)
-- @param engine = ''  one engine ('' = all)
-- @param server = ''  one vLLM server ('' = all)
-- @param limit = 100  rows at most
SELECT *
FROM
(
    SELECT
        ts AS attached,
        model,
        server,
        engine,
        session,
        vllm_version,
        num_blocks,
        block_size,
        kv_group_kinds,
        kv_group_block_sizes,
        kv_group_windows,
        token_budget,
        max_num_batched_tokens,
        max_num_seqs,
        max_model_len,
        policy,
        prefix_caching,
        async_scheduling,
        spec_tokens,
        watermark_blocks
    FROM engine_configs
    WHERE ({model:String} = '' OR model = {model:String})
      AND ({engine:String} = '' OR engine = {engine:String})
      AND ({server:String} = '' OR server = {server:String})
    ORDER BY ts
    LIMIT 1 BY model, server, engine, session
)
ORDER BY attached DESC, server, engine
LIMIT {limit:UInt32}
