"""One vLLM server and sidecar for every module of this package (a server start is
30-70 s of CI). The modules run in file order: ``test_engine`` first (its counts must
equal vLLM's own from the server's first request), ``test_whatif_capacity`` last (it
stops the sidecar to read the store); each of the others reads only what it sent itself
or what holds whatever came before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.conftest import EngineStack, probed_stack


@pytest.fixture(scope="package")
def engine_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[EngineStack]:
    with probed_stack(tiny_model_dir, tmp_path_factory) as stack:
        yield stack
