"""Credentials never reach a log line or an error: ``redact`` on DSNs as users write them."""

from __future__ import annotations

import logging
from typing import Any
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


BAD = ["#", "?", "/", " ", "#?/"]
"""Characters a password must percent-encode in a DSN: urlsplit ends the authority at
them (or, a space, no log scrubber can tell where the password ends)."""


@pytest.mark.parametrize("bad", BAD)
def test_a_dsn_whose_password_needs_encoding_is_refused_without_showing_it(
        bad: str, tmp_path: Any, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvscope.cli import main
    from kvscope.store.sink import ClickHouseSink, Target

    caplog.set_level(logging.DEBUG)
    dsn = f"http://kvuser:Qz7{bad}Vk4@ch.example:8123/db"
    texts = []
    for make in (Target.parse, lambda d: ClickHouseSink(d, spool_dir=str(tmp_path / "s"))):
        with pytest.raises(ValueError) as err:
            make(dsn)
        assert "percent-encode special characters in the password" in str(err.value)
        texts.append(str(err.value))
    monkeypatch.delenv("KVSCOPE_CLICKHOUSE_DSN", raising=False)
    for cmd in (["query", "--dsn", dsn, "hourly_preemptions"],
                ["explain", "--dsn", dsn, "r1"]):
        assert main(cmd) == 2
        err_text = capsys.readouterr().err
        assert "percent-encode" in err_text
        texts.append(err_text)
    texts.append(caplog.text)
    for text in texts:
        assert "Qz7" not in text and "Vk4" not in text, text


@pytest.mark.parametrize("bad", ["#", "?", "/"])
def test_redact_hides_a_password_that_was_not_encoded(bad: str) -> None:
    out = redact(f"cannot reach http://kvuser:Qz7{bad}Vk4@ch.example:8123/db: refused")
    assert "Qz7" not in out and "Vk4" not in out and "ch.example:8123/db" in out


def test_an_encoded_password_is_taken_and_hidden_in_both_spellings() -> None:
    from kvscope.store.sink import Target

    t = Target.parse("http://kvuser:Qz7%23%2FVk4@ch.example:8123/db")
    assert t.database == "db" and t.dsn == "http://kvuser:Qz7%23%2FVk4@ch.example:8123"
    out = t.scrub("auth failed for Qz7%23%2FVk4 (Qz7#/Vk4)")
    assert "Qz7" not in out and "Vk4" not in out


def test_a_dsn_with_a_port_that_is_not_a_number_is_refused_clearly() -> None:
    from kvscope.store.sink import Target

    with pytest.raises(ValueError, match="port"):
        Target.parse("http://kvuser:pw@ch.example:81x23/db")
