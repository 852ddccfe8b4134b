"""Credentials out of what kvscope logs or shows: one place for every URL and DSN."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/@\s:]*):([^/@\s]*)@")
_SECRET_PARAM = re.compile(r"(?i)\b(password|access_token|token)=([^&\s]+)")


def safe_url(url: str) -> str:
    """The URL without user:password, query or fragment: what a log line may show of an
    endpoint kvscope talks to (vLLM's /metrics, Loki)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def redact(text: str) -> str:
    """``text`` (a DSN, an error message) with the password of any URL in it and any
    password/token query parameter hidden."""
    return _SECRET_PARAM.sub(r"\1=***", _USERINFO.sub(r"\1\2:***@", text))
