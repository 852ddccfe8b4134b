"""Start vLLM's OpenAI server on the CPU with a tiny random Llama, the kvscope probe and
kvscope's client middleware: the ``cpu`` profile of docker-compose.yml.

The command line is the one kvscope's engine tests run (kvscope.localvllm.server), bound
to 0.0.0.0 inside the container (compose publishes it on 127.0.0.1 only). Pool size and
scheduling policy come from the environment so the demo can be made to preempt more or less.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvscope.localvllm.server import QUIET_ENV, ServerSpec, command
from kvscope.models.tiny import make_tiny_model


def main() -> None:
    model = make_tiny_model(Path(os.environ.get("KVSCOPE_MODEL_DIR", "/models/tiny")))
    spec = ServerSpec(
        model_dir=model,
        port=int(os.environ.get("VLLM_PORT", "8000")),
        num_gpu_blocks=int(os.environ.get("VLLM_NUM_BLOCKS", "48")),
        scheduling_policy=os.environ.get("VLLM_SCHEDULING_POLICY", "fcfs"),  # type: ignore[arg-type]
        extra_args=("--middleware", "kvscope_probe.middleware.KVScopeMiddleware"),
    )
    argv = command(spec)
    argv[argv.index("--host") + 1] = "0.0.0.0"
    os.environ.update(QUIET_ENV)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
