"""GPU memory and utilization through NVML, absent (with one log line) without a GPU.

``pynvml`` comes from NVIDIA's ``nvidia-ml-py`` distribution. On a machine with no
driver ``nvmlInit`` raises; the reader then reports nothing, forever, and says so once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvscope.sidecar")


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_ratio: float


class GpuReader:
    """Samples every visible GPU; ``available`` is False when NVML cannot start."""

    def __init__(self, nvml: Any = None) -> None:
        self.available = False
        self.reason = ""
        self._nvml = nvml
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self.count = int(self._nvml.nvmlDeviceGetCount())
            self.available = True
        except Exception as exc:  # noqa: BLE001 - NVMLError subclasses, ImportError, OSError
            self.count = 0
            self.reason = f"{type(exc).__name__}: {exc}"
            log.info("no GPU metrics: NVML unavailable (%s)", self.reason)

    def sample(self) -> list[GpuSample]:
        if not self.available:
            return []
        out = []
        nv = self._nvml
        for i in range(self.count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                name = nv.nvmlDeviceGetName(h)
                if isinstance(name, bytes):
                    name = name.decode(errors="replace")
                out.append(GpuSample(i, str(name), int(mem.used), int(mem.total),
                                     float(util.gpu) / 100.0))
            except Exception as exc:  # noqa: BLE001 - a GPU that fell off the bus
                log.warning("NVML read of GPU %d failed: %s", i, exc)
        return out
