"""Exceptions the SDK raises on its own account (transport errors stay httpx's own)."""

from __future__ import annotations


class KVScopeClientError(Exception):
    """Base class of every error the SDK raises itself."""


class CircuitOpenError(KVScopeClientError):
    """The circuit is open: the request was NOT sent. Treat it like a local 429.

    ``retry_after_s`` says when the breaker will let a request (a probe) through again
    while it is open; while it is half-open, waiting for its probes to come back, it is an
    estimate (the current open duration), as when they come back is not known.
    """

    status_code = 429

    def __init__(self, retry_after_s: float, reason: str) -> None:
        self.retry_after_s = max(0.0, retry_after_s)
        self.reason = reason
        super().__init__(
            f"kvscope circuit open, request not sent: {reason}; "
            f"retry after {self.retry_after_s:.1f} s"
        )


class APIStatusError(KVScopeClientError):
    """The server answered with a status the SDK does not retry, or retries ran out.

    ``body`` holds at most 500 characters of the answer; it is never logged.
    ``retry_after_s`` is the server's Retry-After, when it sent one.
    """

    def __init__(self, status_code: int, body: str, attempts: int,
                 retry_after_s: float | None = None) -> None:
        self.status_code = status_code
        self.body = body[:500]
        self.attempts = attempts
        self.retry_after_s = retry_after_s
        hint = (f", server asks to retry after {retry_after_s:.1f} s"
                if retry_after_s is not None else "")
        super().__init__(f"HTTP {status_code} after {attempts} attempt(s){hint}")


class ResponseFormatError(KVScopeClientError):
    """A 2xx answer whose body is not a JSON object."""
