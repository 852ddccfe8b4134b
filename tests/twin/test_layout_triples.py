"""Every combination of the twin matrix for the vLLM this process imports, by hand.

CI runs the pairwise rows of ``test_layout_matrix``; this runs the whole product (64
combinations per vLLM, a few minutes) and prints one line each: steps and preemptions,
or the first difference between the ledger and vLLM's pool. Not collected by pytest::

    .venv/bin/python -m tests.twin.full_matrix
    PYTHONPATH=.cache/vllm-0.33.0:$PYTHONPATH VLLM_TARGET_DEVICE=cpu \\
        .venv/bin/python -m tests.twin.full_matrix
"""

from __future__ import annotations

import itertools

from kvscope.twin import WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin
from tests.twin.exactness import PoolCheck
from tests.twin.test_layout_matrix import AXES, N_REQUESTS, THIS_VLLM, config_of, row_id


def main() -> None:
    names = [n for n in AXES if n != "vllm"]
    for values in itertools.product(*(AXES[n] for n in names)):
        row = dict(zip(names, values, strict=True), vllm=THIS_VLLM)
        probed = ProbedTwin(config_of(row), seed=1)
        check = PoolCheck(probed)
        try:
            result = probed.run(generate(WorkloadSpec(n_requests=N_REQUESTS, seed=1)))
        except AssertionError as exc:
            print(f"{row_id(row)} FAIL {str(exc)[:300]}", flush=True)
            continue
        c = probed.state.counters
        print(f"{row_id(row)} ok {result.steps} steps, {check.preemptions} preemptions "
              f"({c.preemptions['unknown']} unexplained)", flush=True)


if __name__ == "__main__":
    main()
