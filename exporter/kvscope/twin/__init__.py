"""kvscope.twin: vLLM's real scheduler and KV-cache manager, driven in-process without a model.

``config`` and ``workload`` are plain data and import nothing heavy; ``engine`` (the
``Twin`` itself) and ``scheduler`` import vLLM, so import them explicitly::

    from kvscope.twin.engine import Twin

It may import ``kvscope.state`` (the probed twin feeds a Hub), ``kvscope.models`` and
the helpers; not the sidecar, whatif, demo or the CLI.
"""

from kvscope.twin.config import TwinConfig
from kvscope.twin.workload import TwinRequest, WorkloadSpec, generate

__all__ = ["TwinConfig", "TwinRequest", "WorkloadSpec", "generate"]
