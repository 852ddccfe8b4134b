-- Which running requests held the most KV blocks of one engine at the last layout sample
-- of a time range, and in how many fragments (runs of consecutive block IDs) were their
-- blocks scattered? Fragments cost KV transfer descriptors, never attention.
-- @param model = ''   one model ('' = any)
-- @param limit = 20   rows to return
-- @param server = ''   one vLLM server ('' = any)
SELECT
    sampled,
    request_id,
    blocks,
    fragments
FROM
(
    SELECT ts AS sampled, owner_req_ids, owner_blocks, owner_fragments
    FROM layout_snapshots
    WHERE engine = {engine:String}
      AND ({server:String} = '' OR server = {server:String})
      AND ({model:String} = '' OR model = {model:String})
      AND ts >= {since:DateTime64(3)}
      AND ts <= {until:DateTime64(3)}
    ORDER BY ts DESC
    LIMIT 1
)
ARRAY JOIN
    owner_req_ids AS request_id,
    owner_blocks AS blocks,
    owner_fragments AS fragments
ORDER BY blocks DESC, fragments DESC, request_id
LIMIT {limit:UInt32}
