"""kvscope's client side: an SDK with backpressure and a circuit breaker.

The ASGI middleware for vLLM's API server runs inside vLLM, so it ships with the probe:
:mod:`kvscope_probe.middleware`. It may import the shared helpers only (it runs in
the user's own programs).
"""

from kvscope.client.breaker import BreakerSnapshot, CircuitBreaker, State
from kvscope.client.config import ClientConfig
from kvscope.client.core import ClientState
from kvscope.client.errors import (
    APIStatusError,
    CircuitOpenError,
    KVScopeClientError,
    ResponseFormatError,
)
from kvscope.client.preempt_rate import PreemptRateReading
from kvscope.client.sdk import AsyncKVScopeClient, KVScopeClient
from kvscope.client.window import Outcome, SlidingWindow, WindowRates

__all__ = [
    "APIStatusError",
    "AsyncKVScopeClient",
    "BreakerSnapshot",
    "CircuitBreaker",
    "CircuitOpenError",
    "ClientConfig",
    "ClientState",
    "KVScopeClient",
    "KVScopeClientError",
    "Outcome",
    "PreemptRateReading",
    "ResponseFormatError",
    "SlidingWindow",
    "State",
    "WindowRates",
]
