"""``kvscope whatif``: workloads through vLLM's real scheduler (the twin) under several
settings. ``cli`` is the command; ``settings`` parses the grid, ``replay`` reads recorded
traffic, ``measure`` runs one setting with kvscope's probe and hub, ``report`` and
``chart`` render the comparison."""
