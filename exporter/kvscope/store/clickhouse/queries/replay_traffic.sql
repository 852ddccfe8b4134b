-- Recorded traffic for `kvscope whatif --replay`: one row per request that ended on one
-- engine between `since` and `until` (epoch seconds of arrival), in the order the
-- scheduler queued them: its lengths and priority, the engine step it arrived in and the
-- step it was first admitted in and the step it ended in (0-based, as the twin counts
-- steps: a request sent the moment another ended arrives in that end's step, so
-- arrival_step - finished_step is how many steps the client took), and what the server
-- did with it: preemptions, tokens
-- computed again, prompt tokens the prefix cache served, the fewest free blocks left
-- after a step that gave it blocks. `--format json` is a replay file; whatif replays the
-- arrivals step for step and reports how far its own figures are from these. Steps count
-- from the engine's start, so one replay is one engine's: a window holding several (every
-- server's first engine is 0) is refused with the parameters to give. An engine that
-- restarts counts steps from 1 again, under a new probe session and maybe other settings:
-- `session` is the one the request arrived in (the latest `engine_configs` session
-- attached at or before its arrival; '' when that table has none) and `session_start`
-- when that session's probe attached (epoch seconds). The sidecar numbers the steps
-- itself, so they also count from 1 again when the sidecar restarts while the engine runs
-- on (it takes the same session up again, and writes its `engine_configs` row as it was):
-- `step_counter` names the sidecar count the request arrived in (the latest count of the
-- engine begun at or before its arrival, as `request_events.step_counter` names them; ''
-- for rows written before that column) and `step_counter_start` when that count's first
-- row is dated (epoch seconds; 0 for ''). whatif refuses a window over either restart and
-- names the windows on either side. A window is its arrivals: requests of the engine's
-- life that arrived before `since` and had not ended by then, and requests that arrived
-- in it with no end stored when it is read (or one stored only by a later sidecar count),
-- are not in it; nor are requests traced in it with no `queued` row stored in the count
-- they arrived in (their arrival unseen, so its step unknown: the row was lost in a gap,
-- or the request was queued before the sidecar heard the engine or before it restarted,
-- and its trace dates it from its admission). Every row counts the three
-- (`left_out_started_before`, `left_out_not_ended`, `left_out_not_queued`) so the replay
-- can say so.
-- @param since = 0            earliest arrival, epoch seconds
-- @param until = 99999999999  latest arrival, epoch seconds
-- @param model = ''           one model ('' = all)
-- @param engine = ''          one engine ('' = all)
-- @param server = ''          one vLLM server ('' = all)
SELECT request_id, engine, prompt_len, output_len, max_gen_len, priority, arrival_step,
       admitted_step, finished_step, preempt_count, recomputed_tokens, cached_tokens,
       min_free_blocks, finish_reason, session, session_start, step_counter,
       step_counter_start, left_out_started_before, left_out_not_ended, left_out_not_queued
FROM
(
SELECT
    t.request_id AS request_id,
    t.engine AS engine,
    t.prompt_len AS prompt_len,
    t.output_len AS output_len,
    t.max_gen_len AS max_gen_len,
    e.priority AS priority,
    e.queued_step - 1 AS arrival_step,
    e.admitted_step - 1 AS admitted_step,
    e.finished_step - 1 AS finished_step,
    t.preempt_count AS preempt_count,
    t.recomputed_tokens AS recomputed_tokens,
    t.cached_tokens AS cached_tokens,
    e.min_free_blocks AS min_free_blocks,
    t.finish_reason AS finish_reason,
    s.session AS session,
    s.attached AS session_start,
    c.step_counter AS step_counter,
    c.counted_from AS step_counter_start,
    o.started_before AS left_out_started_before,
    o.not_ended AS left_out_not_ended,
    -- a trace with no queued row in the count it arrived in has no arrival step in it:
    -- not replayed, but counted
    e.request_id != '' AND e.step_counter = c.step_counter AS queued,
    countIf(NOT queued) OVER () AS left_out_not_queued,
    e.position AS position
FROM request_traces AS t
LEFT JOIN
(
    SELECT
        server,
        engine,
        request_id,
        minIf(step, event = 'queued') AS queued_step,
        anyIf(step_counter, event = 'queued') AS step_counter,
        minIf(toInt64OrZero(extract(detail, 'position=([0-9]+)')), event = 'queued') AS position,
        minIf(toInt64OrZero(extract(detail, 'priority=(-?[0-9]+)')), event = 'queued') AS priority,
        minOrNullIf(step, event = 'admitted') AS admitted_step,
        maxOrNullIf(step, event IN ('finished', 'aborted')) AS finished_step,
        minOrNullIf(free_blocks, event IN ('admitted', 'resumed', 'allocated')
                    AND free_blocks >= 0) AS min_free_blocks
    FROM request_events_all
    WHERE ({engine:String} = '' OR engine = {engine:String})
      AND ({server:String} = '' OR server = {server:String})
    GROUP BY server, engine, request_id
    HAVING countIf(event = 'queued') > 0
) AS e ON e.server = t.server AND e.engine = t.engine AND e.request_id = t.request_id
ASOF LEFT JOIN
(
    -- a session's row is written again every hour: it attached at its first
    SELECT server, engine, session, toFloat64(min(ts)) AS attached
    FROM engine_configs
    WHERE ({engine:String} = '' OR engine = {engine:String})
      AND ({server:String} = '' OR server = {server:String})
    GROUP BY server, engine, session
) AS s ON s.server = t.server AND s.engine = t.engine AND s.attached <= toFloat64(t.arrival_ts)
ASOF LEFT JOIN
(
    -- a count began with its first row: a queued row is dated by the request's arrival,
    -- so every request a count queued arrived at or after it began, and every trace of a
    -- request it did not see arrive is dated by an admission, resume or take-up it stored
    SELECT server, engine, step_counter, toFloat64(min(ts)) AS counted_from
    FROM request_events
    WHERE step_counter != ''
      AND ({engine:String} = '' OR engine = {engine:String})
      AND ({server:String} = '' OR server = {server:String})
    GROUP BY server, engine, step_counter
) AS c ON c.server = t.server AND c.engine = t.engine
      AND c.counted_from <= toFloat64(t.arrival_ts)
LEFT JOIN
(
    -- a request's arrival is its queued row's (its trace's too, when the sidecar that
    -- queued it traced it). Requests of an earlier life never end: the life at `since`
    -- began when its session attached (0: no engine_configs row). One whose trace is in
    -- the window is the window's (replayed, or counted as not queued)
    SELECT
        q.server AS server,
        q.engine AS engine,
        countIf(q.arrived < {since:Float64} AND q.arrived >= ifNull(l.life_start, 0)
                AND NOT (q.ended AND q.end_s < {since:Float64}) AND NOT q.traced_in)
            AS started_before,
        countIf(q.arrived BETWEEN {since:Float64} AND {until:Float64} AND NOT q.traced_in)
            AS not_ended
    FROM
    (
        SELECT
            qe.server AS server,
            qe.engine AS engine,
            qe.queued AS arrived,
            tr.request_id != '' AS ended,
            toFloat64(tr.ts) AS end_s,
            ended AND toFloat64(tr.arrival_ts) BETWEEN {since:Float64} AND {until:Float64}
                AS traced_in
        FROM
        (
            SELECT server, engine, request_id, toFloat64(min(ts)) AS queued
            FROM request_events
            WHERE event = 'queued'
              AND ({model:String} = '' OR model = {model:String})
              AND ({engine:String} = '' OR engine = {engine:String})
              AND ({server:String} = '' OR server = {server:String})
            GROUP BY server, engine, request_id
        ) AS qe
        LEFT JOIN
        (
            SELECT server, engine, request_id, arrival_ts, ts
            FROM request_traces
            WHERE ({model:String} = '' OR model = {model:String})
              AND ({engine:String} = '' OR engine = {engine:String})
              AND ({server:String} = '' OR server = {server:String})
        ) AS tr ON tr.server = qe.server AND tr.engine = qe.engine AND tr.request_id = qe.request_id
    ) AS q
    LEFT JOIN
    (
        SELECT server, engine, max(attached) AS life_start
        FROM
        (
            SELECT server, engine, session, toFloat64(min(ts)) AS attached
            FROM engine_configs
            WHERE ({engine:String} = '' OR engine = {engine:String})
              AND ({server:String} = '' OR server = {server:String})
            GROUP BY server, engine, session
        )
        WHERE attached <= {since:Float64}
        GROUP BY server, engine
    ) AS l ON l.server = q.server AND l.engine = q.engine
    GROUP BY q.server, q.engine
) AS o ON o.server = t.server AND o.engine = t.engine
WHERE toFloat64(t.arrival_ts) BETWEEN {since:Float64} AND {until:Float64}
  AND ({model:String} = '' OR t.model = {model:String})
  AND ({engine:String} = '' OR t.engine = {engine:String})
  AND ({server:String} = '' OR t.server = {server:String})
  AND throwIf((SELECT uniqExact(server, engine) FROM request_traces
               WHERE toFloat64(arrival_ts) BETWEEN {since:Float64} AND {until:Float64}
                 AND ({model:String} = '' OR model = {model:String})
                 AND ({engine:String} = '' OR engine = {engine:String})
                 AND ({server:String} = '' OR server = {server:String})) > 1,
              'the window holds requests of several engines: give --param server= and --param engine= (each server numbers its engines from 0)') = 0
)
WHERE queued
ORDER BY arrival_step, position, request_id
