"""Credentials out of what kvscope logs or shows: one place for every URL and DSN."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/@\s:]*):(\S*)@")
"""user:password@ up to the last @ before a space: a password may hold an @, # ? or / its
owner did not percent-encode (``u:p@ss@host``, ``u:p#ss@host``), and it all goes (with a
path's, should one hold an @ too: hiding more is the safe side)."""
_SECRET_PARAM = re.compile(
    r"(?i)\b(password|passwd|pass|pwd|secret|access_token|token|api_key|apikey)=([^&\s]+)")


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
