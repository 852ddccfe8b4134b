"""One vLLM server and sidecar for every module of this package (a server start is
30-70 s of CI). The modules run in file order: ``test_engine`` first (its counts must
equal vLLM's own from the server's first request), ``test_sidecar_restart`` and
``test_whatif_capacity`` last (they stop the sidecar); each of the others reads only what
it sent itself or what holds whatever came before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine.conftest import EngineStack, probed_stack
from tests.engine.figures import wait_for_synced_engine


@pytest.fixture(scope="package")
def engine_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[EngineStack]:
    with probed_stack(tiny_model_dir, tmp_path_factory) as stack:
        yield stack


@pytest.fixture(scope="package")
def first_engine(engine_stack: EngineStack) -> dict[str, Any]:
    """Send one completion (the probe attached when vLLM built its scheduler) and return the
    sidecar's summary of engine "0" once its ledger is in sync."""
    response = httpx.post(
        f"{engine_stack.vllm.url}/v1/completions", timeout=60.0, trust_env=False,
        json={"model": "tiny", "prompt": "w1 w2 w3 w4", "max_tokens": 8, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    return wait_for_synced_engine(engine_stack, timeout_s=30.0)
