"""One engine process for test_many_engines: vLLM's real scheduler (the twin) with the
probe attached by the plugin, as in a vLLM EngineCore, streaming through a real Sender.

    python -m tests.reliability.twinworker DP_INDEX SEED N_REQUESTS

``KVSCOPE_PROBE_ENDPOINT`` (and the secret) come from the environment, like
``KVSCOPE_SERVER``. The DP index is set on the config's ``parallel_config`` before the
scheduler is built, the way vLLM's data-parallel EngineCore sets it
(``data_parallel_index = dp_rank``, while ``data_parallel_rank`` stays 0 for a dense
model). After the run, once every record has left, the worker prints one JSON line with the
truth of its pool, then idles (its probe heartbeats) until stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> int:
    dp_index, seed, n = (int(a) for a in sys.argv[1:4])
    from kvscope.twin import TwinConfig, WorkloadSpec, generate
    from kvscope.twin import scheduler as twin_scheduler
    from kvscope.twin.engine import Twin
    from kvscope_probe import plugin

    if not plugin.enable(os.environ["KVSCOPE_PROBE_ENDPOINT"]):
        print(json.dumps({"error": "the probe could not attach"}), flush=True)
        return 1
    base = twin_scheduler.vllm_config

    def dp_rank_config(*args: Any, **kwargs: Any) -> Any:
        # What vLLM's DP EngineCore does before it builds its scheduler (the probe
        # attaches then): the index is the rank, the rank is 0 for a dense model.
        config = base(*args, **kwargs)
        pc = config.parallel_config
        pc.data_parallel_index, pc.data_parallel_rank = dp_index, 0
        return config

    twin_scheduler.vllm_config = dp_rank_config
    twin = Twin(TwinConfig(num_blocks=64), seed=seed)
    result = twin.run(generate(WorkloadSpec(n_requests=n, seed=seed)))
    rec = twin.scheduler.__dict__["_kvscope"]
    (sender,) = plugin._senders
    deadline = time.monotonic() + 60
    while (rec.ring or sender.sent + rec.ring_dropped + rec.send_dropped < rec.seq) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    pool = twin.scheduler.kv_cache_manager.block_pool
    print(json.dumps({
        "pid": os.getpid(), "session": rec.hello.session, "server": rec.hello.server,
        "engine": rec.hello.engine, "dp_rank": rec.hello.dp_rank, "steps": result.steps,
        "preemptions": result.preemptions, "finished": result.finished, "requests": n,
        "free_blocks": pool.get_num_free_blocks(), "records": rec.seq, "sent": sender.sent,
        "dropped": rec.ring_dropped + rec.send_dropped, "faults": rec.faults,
    }), flush=True)
    sys.stdin.read()  # idle until the test closes stdin: the probe heartbeats meanwhile
    plugin.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
