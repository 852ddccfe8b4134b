"""``kvscope demo``: a whole stack on one machine (twin or real vLLM engines, the sidecar,
Prometheus, a store) driven by a workload that preempts, then what it found.

``run`` orchestrates; ``engines`` starts the engines, ``twin_server`` is the twin behind an
OpenAI-shaped HTTP API, ``workload`` is the load, ``live`` the progress view, ``findings``
the closing report.

It may import the twin, the sidecar, the client SDK and everything below; not the CLI.
"""
