"""``kvscope explain``: one request's latency story from the store (timeline, lost time,
who held the pool at each decision).

Its story (answer, story, holders, source, renderers, api) reads the store only and may
import rows, state, sinks, store and layout; the sidecar serves it at /api/requests/{id}.
``counterfactual`` (the twin through whatif) and ``cli`` (the command) sit with the programs
above the twin and may import anything below the cli.
"""
