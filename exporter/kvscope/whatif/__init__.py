"""``kvscope whatif``: workloads through vLLM's real scheduler (the twin) under several
settings. ``cli`` is the command and ``plan`` reads its arguments; ``settings`` parses the
grid, ``replay`` reads recorded traffic, ``measure`` runs one setting with kvscope's probe
and hub, ``recorded`` measures a run from its per-request records and holds the fidelity
gate, ``concurrency`` and ``safe`` answer the safe concurrency, ``report``, ``chart`` and
``progress`` render.

It may import the twin, ``kvscope.state`` and everything below; not the sidecar's server
or the CLI.
"""
