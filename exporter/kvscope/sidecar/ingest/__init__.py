"""kvscope.sidecar.ingest: the probe socket (``receiver``) and its CURVE authentication
(``auth``); each frame is handed to ``kvscope.state.hub.Hub``.

It may import ``kvscope.state`` and the probe's transport; not exposition or HTTP.
"""
