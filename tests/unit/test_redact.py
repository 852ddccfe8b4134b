"""Credentials never reach a log line or an error: ``redact`` on DSNs as users write them."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from kvscope.redact import redact


@pytest.mark.parametrize("dsn, secret", [
    ("http://u:p@ss@host:8123/db", "p@ss"),  # an @ left unencoded: urlsplit takes it all
    ("https://kvscope:s3cr3t@ch.example:8443/kvscope?secure=1", "s3cr3t"),
    ("http://u:a@b@c@host/db", "a@b@c"),
])
def test_the_whole_password_is_hidden(dsn: str, secret: str) -> None:
    assert urlsplit(dsn).password == secret  # what the sidecar connects with
    out = redact(f"cannot reach {dsn}: refused")
    assert secret not in out and secret.split("@")[-1] + "@" not in out
    assert "***" in out and urlsplit(dsn).hostname in out


@pytest.mark.parametrize("param", ["password", "pass", "pwd", "secret", "api_key", "token"])
def test_secret_query_parameters_are_hidden(param: str) -> None:
    out = redact(f"http://host:8123/?{param}=hunter2&database=kvscope")
    assert "hunter2" not in out and "database=kvscope" in out
