"""The twin under pressure plus the client events kvscope's middleware would send, for the
dashboard tests: ``python -m tests.stack.dashfeed ENDPOINT``.

vLLM's real scheduler runs promstack's PRESSURE workload with the probe attached. Each
request is named as vLLM 0.32 names a completion it got through kvscope's middleware
(``cmpl-kvs<32 hex>-0-<8 hex>``), and the middleware's real Emitter sends a
``wire.ClientStart`` for it (three clients, three user agents, every eighth request a
resubmission of the previous prompt) and a ``wire.ClientEnd`` once the twin finished it.
So the sidecar joins client events to engine traces exactly as it does behind a server.

Prints READY after the (slow) vLLM imports, waits for a line on stdin, prints
``DONE {json}`` at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time

import msgspec

from kvscope.twin import TwinConfig, generate
from kvscope.twin.workload import TwinRequest
from kvscope_probe import wire
from kvscope_probe.emitter import Emitter
from kvscope_probe.middleware import prompt_digest
from tests.stack.promstack import PRESSURE, PRESSURE_MAX_STEPS, PRESSURE_STEP_S

CLIENTS = (
    # (client_id header, User-Agent, API-key hash): the third has only an API key.
    ("batch-etl", "python-httpx/0.27.0", ""),
    ("chat-ui", "openai-python/1.51.0", ""),
    ("", "curl/8.5.0", "5f2b9c0d1e3a4b6c"),
)
DUPLICATE_EVERY = 8
MODEL = "twin"


def workload(seed: int = 3) -> tuple[list[TwinRequest], dict[str, wire.ClientStart]]:
    """PRESSURE's requests under middleware-style IDs, and each one's ClientStart by
    engine request ID (``ts`` 0: ``stamped`` gives it its send time)."""
    rng = random.Random(seed)
    requests: list[TwinRequest] = []
    starts: dict[str, wire.ClientStart] = {}
    for i, r in enumerate(generate(PRESSURE)):
        client = CLIENTS[i % len(CLIENTS)]
        if i % DUPLICATE_EVERY == DUPLICATE_EVERY - 1:
            prev = requests[-1]  # resubmitted by the same client, a moment later
            client = next(c for c in CLIENTS if c[0] == starts[prev.request_id].client_id
                          and c[2] == starts[prev.request_id].api_key_sha256)
            r = dataclasses.replace(r, prompt_token_ids=prev.prompt_token_ids)
        ext = f"kvs{rng.getrandbits(128):032x}"
        engine_id = f"cmpl-{ext}-0-{rng.getrandbits(32):08x}"
        requests.append(dataclasses.replace(r, request_id=engine_id))
        phash, chars = prompt_digest("completions", {"prompt": list(r.prompt_token_ids)})
        starts[engine_id] = wire.ClientStart(
            request_id=ext, ts=0.0, endpoint="completions", model=MODEL,
            client_id=client[0], user_agent=client[1], api_key_sha256=client[2],
            prompt_sha256=phash, prompt_chars=chars, max_tokens=r.max_tokens)
    return requests, starts


def stamped(starts: dict[str, wire.ClientStart]) -> dict[str, wire.ClientStart]:
    """Each start stamped now, in order, as the middleware stamps a call when the API
    server receives it: before vLLM stamps its arrival. (Stamped when the workload was
    built, before READY, a start read later than its request's arrival whenever the go
    came quickly, and the sidecar rightly joined no trace to it.)"""
    now = time.time()
    return {rid: msgspec.structs.replace(s, ts=now + i * 1e-6)
            for i, (rid, s) in enumerate(starts.items())}


def feed(endpoint: str) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from kvscope.twin.engine import Twin
    from kvscope_probe import plugin

    if not plugin.enable(endpoint):
        raise SystemExit("the kvscope probe could not attach to this vLLM")
    twin = Twin(TwinConfig(num_blocks=48))
    requests, starts = workload()
    emitter = Emitter(endpoint)
    print("READY", flush=True)
    sys.stdin.readline()
    starts = stamped(starts)
    for s in starts.values():
        emitter.emit(s)
    open_ids, seen = set(starts), set()
    ended = 0

    def on_step(i: int, _out: object) -> None:
        """Every 10 steps: a request seen in the scheduler and gone since has finished
        (each runs for at least 64 steps, so none is missed)."""
        nonlocal ended
        if i % 10:
            return
        live = twin.scheduler.requests
        for rid in list(open_ids):
            if rid in live:
                seen.add(rid)
            elif rid in seen:
                open_ids.discard(rid)
                s = starts[rid]
                emitter.emit(wire.ClientEnd(request_id=s.request_id, ts=time.time(),
                                            status=200, duration_s=round(time.time() - s.ts, 3)))
                ended += 1

    result = twin.run(requests, on_step=on_step, step_interval_s=PRESSURE_STEP_S,
                      max_steps=PRESSURE_MAX_STEPS)
    plugin.stop_all()
    deadline = time.monotonic() + 10
    while emitter.queue and time.monotonic() < deadline:
        time.sleep(0.05)
    emitter.close()  # the last batch's send finished, its socket and thread ended
    done = {"steps": result.steps, "preemptions": result.preemptions,
            "finished": result.finished, "client_ends": ended,
            "client_events_sent": emitter.sent, "client_events_dropped": emitter.dropped,
            "seconds": round(result.wall_seconds, 1)}
    print("DONE " + json.dumps(done), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "feed":
        feed(sys.argv[2])
    else:
        raise SystemExit("usage: python -m tests.stack.dashfeed feed ENDPOINT")
