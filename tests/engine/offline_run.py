"""vLLM's offline ``LLM`` on the tiny model, every request added before the first step:
the one way to give a real engine arrivals it cannot reorder (an API server admits
requests as its event loop gets to them). The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): with its own process, it began stepping while
``generate`` was still adding requests (request 0 arrived at step 0, the rest at step 1,
in one run; another split them otherwise). Run as a child with the probe's variables set:

python -m tests.engine.offline_run MODEL_DIR BLOCKS N PROMPT_WORDS MAX_TOKENS SIDECAR_URL

prints one JSON line: each request's ID, in the order the prompts were given, and how many
requests the sidecar saw end. After ``generate`` it takes the one more step vLLM's engine
loop takes to report the last finished requests (``generate`` stops when the outputs are
done; the probe sends a step's ends with the next step's record), then waits for the
sidecar to have them.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx


def prompts(n: int, words: int) -> list[str]:
    """Prompts that share no first block (no prefix-cache hits a replay cannot rebuild)."""
    return [" ".join(f"w{(i * 37 + k * 11) % 997}" for k in range(words)) for i in range(n)]


def main() -> None:
    model, blocks, n, words, max_tokens = sys.argv[1], *map(int, sys.argv[2:6])
    sidecar = sys.argv[6]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from kvscope.localvllm.server import ServerSpec

    spec = ServerSpec(model_dir=model, port=1, num_gpu_blocks=blocks)  # the servers' shape
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=spec.block_size,
              num_gpu_blocks_override=blocks, kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
              max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs,
              max_num_batched_tokens=spec.max_num_batched_tokens, seed=0)
    outs = llm.generate(prompts(n, words),
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
                        use_tqdm=False)
    llm.llm_engine.step()  # the scheduler reports the last finished requests
    ended = wait_for_ends(sidecar, n)
    print(json.dumps({"request_ids": [o.request_id for o in outs], "ended": ended,
                      "output_tokens": [len(o.outputs[0].token_ids) for o in outs]}),
          flush=True)


def wait_for_ends(sidecar: str, n: int, timeout_s: float = 60.0) -> int:
    """Requests the sidecar has seen end, once it is ``n`` or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{sidecar}/api/engines", timeout=10, trust_env=False).json()
        ended = sum(sum(e["requests_ended"].values()) for e in body["engines"])
        if ended >= n or time.monotonic() > deadline:
            return ended
        time.sleep(0.2)


if __name__ == "__main__":
    main()
