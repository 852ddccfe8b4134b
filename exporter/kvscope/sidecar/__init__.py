"""kvscope.sidecar: the running process, ``kvscope serve``.

``ingest/`` receives the probe's frames into the state, ``exposition/`` turns the state into
Prometheus metrics, ``http/`` serves them and the JSON routes; ``server`` builds all of it
from one ``config.ServeConfig``.

It may import the state (``kvscope.state``), the sinks (``kvscope.sinks``, ``kvscope.store``,
``kvscope.decisions``), the layout sampler and page (``kvscope.layout``) and everything
below them; never the twin, whatif, demo or the CLI.
"""
