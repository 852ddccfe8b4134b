"""kvscope's probe: the code that runs inside vLLM, and the wire contract.

Its own light distribution (``kvscope-probe``), depending only on what vLLM installs
(msgspec, pyzmq), so a vLLM image gets it with ``pip install --no-deps --target DIR``
and ``PYTHONPATH=DIR``. It imports nothing from ``kvscope`` (the sidecar).

- ``plugin``: the ``vllm.general_plugins`` entry point; ``hooks``: the wrappers around
  vLLM's scheduler and block pool; ``recorder``: the per-scheduler step record (engine
  thread); ``sender``: the background thread that encodes and sends it;
- ``wire``: the versioned records both sides agree on; ``reasons``: preemption reasons;
- ``middleware`` and ``emitter``: the ASGI middleware for vLLM's API server.
"""

__version__ = "0.1.0"
