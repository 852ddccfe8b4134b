-- Which KV blocks of one engine were free, cached (free, evictable prefix-cache data),
-- allocated or null over a time range? A block ID x time heatmap coloured by state.
-- One row per cell: time (start of a time_bucket_s bucket), block (first block ID of a
-- block_bucket-wide cell) and state, the state most samples of the cell had, a tie
-- going to the higher state (0 free, 1 cached, 2 allocated, 3 null: map these four
-- values to colours). The tie-break makes every run give the same cells: topK's order
-- among equal counts is not fixed, and two runs of one query disagreed.
-- Parameters: engine, model ('' = any), since / until (UTC, whatever the store's time
-- zone: 'YYYY-MM-DD hh:mm:ss[.fff]' or epoch seconds),
-- time_bucket_s (1 = every stored sample: one every --layout-store-interval, 60 s by
-- default), block_bucket (1 = every block), kv_group (-1 = all
-- groups; g = blocks of group g and the shared free ones).
-- Grafana (ClickHouse plugin): engine = '${engine}', model = '${model}',
-- since = $__fromTime, until = $__toTime, time_bucket_s = greatest($__interval_s, 1);
-- format "Time series" off, a Heatmap panel with "Y axis: block", values as colours.
-- @param model = ''          one model ('' = any)
-- @param time_bucket_s = 1   seconds per time bucket
-- @param block_bucket = 1    block IDs per cell
-- @param kv_group = -1       one KV cache group (-1 = all)
-- @param server = ''   one vLLM server ('' = any)
SELECT time, block, argMax(state, (samples, state)) AS state
FROM
(
    SELECT
        toStartOfInterval(ts, toIntervalSecond({time_bucket_s:UInt32})) AS time,
        intDiv(pos - 1, {block_bucket:UInt32}) * {block_bucket:UInt32} AS block,
        state,
        count() AS samples
    FROM layout_snapshots
    ARRAY JOIN
        states AS state,
        block_group AS grp,
        arrayEnumerate(states) AS pos
    WHERE engine = {engine:String}
      AND ({server:String} = '' OR server = {server:String})
      AND ({model:String} = '' OR model = {model:String})
      AND ts >= {since:DateTime64(3, 'UTC')}
      AND ts <= {until:DateTime64(3, 'UTC')}
      AND ({kv_group:Int8} = -1 OR grp = -1 OR grp = {kv_group:Int8})
      AND throwIf((SELECT uniqExact(server) FROM layout_snapshots
                   WHERE engine = {engine:String}
                     AND ({server:String} = '' OR server = {server:String})
                     AND ({model:String} = '' OR model = {model:String})
                     AND ts >= {since:DateTime64(3, 'UTC')}
                     AND ts <= {until:DateTime64(3, 'UTC')}) > 1,
                  'this engine name has samples from several vLLM servers in the range: give --param server= (each server numbers its engines from 0)') = 0
    GROUP BY time, block, state
)
GROUP BY time, block
ORDER BY time, block
