"""The probe names a vLLM outside its tested range in one log line and records only what
the structural check confirms."""

from __future__ import annotations

import pytest

from kvscope_probe.plugin import TESTED_VLLM, version_warning


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.2rc1"])
def test_tested_versions_log_nothing(version: str) -> None:
    assert version_warning(version) is None


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "unknown"])
def test_other_versions_get_one_clear_line(version: str) -> None:
    line = version_warning(version)
    assert line is not None and "\n" not in line
    assert f"vLLM {version} is outside the tested range" in line
    assert f"({TESTED_VLLM[0]} to {TESTED_VLLM[-1]})" in line
    assert "recording only what the structural check of its classes confirms" in line
