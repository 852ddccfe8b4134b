"""``kvscope explain``: one request's latency story from the store (timeline, lost time,
who held the pool at each decision)."""
