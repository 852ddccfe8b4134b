-- How full was one engine's KV block pool at each layout sample over a time range? Per
-- stored sample (one every --layout-store-interval, 60 s by default; the live page samples
-- every second but stores that one): free blocks (evictable prefix-cache blocks included),
-- cached (free but holding prefix-cache data), used, the longest run of consecutive free
-- block IDs, and running / waiting requests. The same samples as layout_heatmap.sql.
-- @param model = ''   one model ('' = any)
-- @param server = ''   one vLLM server ('' = any)
SELECT
    ts AS time,
    free_blocks,
    cached_blocks,
    used_blocks,
    max_contiguous_free,
    running,
    waiting
FROM layout_snapshots
WHERE engine = {engine:String}
  AND ({server:String} = '' OR server = {server:String})
  AND ({model:String} = '' OR model = {model:String})
  AND ts >= {since:DateTime64(3)}
  AND ts <= {until:DateTime64(3)}
ORDER BY time
