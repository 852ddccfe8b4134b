"""What one keyframe costs vLLM's engine thread when the pool is full (issue 25).

    python benchmarks/keyframe_cost.py [--blocks 32768 131072] [--running 256] [--repeat 5]

A keyframe copies the probe's mirror of the pool (no scan) and reads every running
request's block table through vLLM's ``get_block_ids``: a cost that grows with the
blocks held. For each pool, vLLM's real scheduler (the twin, 16-token blocks, no prefix
caching) admits ``--running`` requests whose prompts fill it, every prefill computed;
then ``Recorder.keyframe`` runs ``--repeat`` times, each followed by the slices the next
steps would read (``keyframe_slice``, back to back here: at most
``KEYFRAME_SLICE_BLOCKS`` table entries a step); printed per run (ms): the whole
keyframe's time, its longest single step (the pause vLLM sees) and its steps, with the
interval the probe then keeps before the next one: at least the keyframe's time /
``FORCED_KEYFRAME_SHARE`` (1%). A report: a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "exporter"))


def measure(blocks: int, running: int, repeat: int) -> dict[str, object]:
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from kvscope.twin import TwinConfig
    from kvscope.twin.engine import Twin
    from kvscope_probe import plugin, recorder
    from kvscope_probe.recorder import Recorder

    prompt = (blocks - 1) // running * 16 - 16
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=blocks, block_size=16, max_num_seqs=running,
                           max_num_batched_tokens=prompt * 4, max_model_len=prompt + 64,
                           enable_prefix_caching=False,
                           max_position_embeddings=prompt + 64), seed=1)
    sched = twin.scheduler
    rec = Recorder(sched, ring_size=1 << 20, keyframe_interval_s=3600)
    plugin.bind(sched, rec)
    for i in range(running):
        sched.add_request(Request(f"r{i}", [i % 1000 + 1] * prompt,
                                  SamplingParams(max_tokens=32), None, None,
                                  arrival_time=time.time()))
    while sched.waiting:
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[] for _ in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=[]))
    pool = sched.kv_cache_manager.block_pool
    held = pool.num_gpu_blocks - pool.get_num_free_blocks()
    took, pauses, slices = [], [], []
    for _ in range(repeat):
        t = time.perf_counter_ns()
        rec.keyframe(t)
        each = [time.perf_counter_ns() - t]
        while rec.kf_rest is not None:  # the slices the next steps read, back to back here
            t = time.perf_counter_ns()
            rec.keyframe_slice(t)
            each.append(time.perf_counter_ns() - t)
        took.append(sum(each) / 1e6)
        pauses.append(max(each) / 1e6)
        slices.append(len(each))
    plugin.stop_all()
    return {"blocks": blocks, "running": len(sched.running), "held": held,
            "keyframe_ms": [round(x, 2) for x in took],
            "longest_step_ms": [round(x, 2) for x in pauses], "steps": slices,
            "next_after_s_at_least": round(max(took) / recorder.FORCED_KEYFRAME_SHARE / 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = [measure(b, args.running, args.repeat) for b in args.blocks]
    print(f"{'blocks':>8} {'running':>8} {'held':>8} {'steps':>6}  keyframe ms, all its steps"
          "  /  its longest step, ms (each run)")
    for r in rows:
        print(f"{r['blocks']:>8} {r['running']:>8} {r['held']:>8} {r['steps'][0]:>6}  "
              f"{r['keyframe_ms']}  /  {r['longest_step_ms']}")
    print(json.dumps({"keyframe_cost": rows}))


if __name__ == "__main__":
    main()
