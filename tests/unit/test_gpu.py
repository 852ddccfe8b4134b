"""NVML: absent on this machine (degrades to nothing), sampled when present."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvscope.sidecar.exposition.gpu import GpuReader


def test_without_a_gpu_the_reader_reports_nothing_and_says_why_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="kvscope.sidecar"):
        reader = GpuReader()  # the real pynvml: no driver on this machine
    assert not reader.available and reader.sample() == []
    assert "NVML unavailable" in caplog.text
    assert reader.reason


class FakeNvml:
    """Imitates the five pynvml calls GpuReader makes, for one 80 GB GPU."""

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: return 1
    def nvmlDeviceGetHandleByIndex(self, i: int) -> int: return i
    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=60 << 30, total=80 << 30)
    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=87)
    def nvmlDeviceGetName(self, h: int) -> bytes: return b"NVIDIA H100"


def test_with_nvml_every_gpu_is_sampled() -> None:
    (s,) = GpuReader(FakeNvml()).sample()
    assert (s.name, s.memory_used_bytes, s.utilization_ratio) == ("NVIDIA H100", 60 << 30, 0.87)
