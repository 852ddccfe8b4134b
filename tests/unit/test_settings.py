"""The settings table is the one source of serve's flags, variables, defaults and README."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvscope.cli import build_parser
from kvscope.errors import ConfigError
from kvscope.settings import SETTINGS, markdown_table
from kvscope.sidecar.config import ENV, ServeConfig, from_sources

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_table_is_the_generated_one() -> None:
    assert markdown_table() in README.read_text()


def test_every_config_field_is_one_setting_with_its_default() -> None:
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    assert fields == {s.name for s in SETTINGS}
    assert len(SETTINGS) == len(fields)
    cfg = ServeConfig()
    for s in SETTINGS:
        assert getattr(cfg, s.name) == s.default_value(), s.name


def test_every_flag_and_variable_comes_from_the_table() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {a.option_strings[0]: a.dest for a in serve._actions if a.dest != "help"}
    assert flags == {s.flag: s.name for s in SETTINGS if s.flag is not None}
    assert ENV == {s.name: s.env for s in SETTINGS}


def test_every_unreadable_value_is_listed_in_one_error() -> None:
    env = {"KVSCOPE_PORT": "http", "KVSCOPE_HEALTH_TIMEOUT_S": "soon",
           "KVSCOPE_RECEIVE_BUFFER_BYTES": "1 GiB"}
    with pytest.raises(ConfigError) as err:
        from_sources({}, env)
    assert err.value.errors == [
        "port (KVSCOPE_PORT): cannot read 'http'",
        "health_timeout_s (KVSCOPE_HEALTH_TIMEOUT_S): cannot read 'soon'",
        "receive_buffer_bytes (KVSCOPE_RECEIVE_BUFFER_BYTES): cannot read '1 GiB'",
    ]
