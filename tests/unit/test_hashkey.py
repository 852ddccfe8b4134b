"""The secret that keys stored hashes: generated once in the data directory, or given."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvscope.errors import ConfigError
from kvscope.sidecar.config import ServeConfig
from kvscope.state.hashkey import KEY_FILE_NAME, Keyer, load_or_create, read_key


def test_generated_once_private_and_kept(tmp_path: Path) -> None:
    data = tmp_path / "data"
    key = load_or_create(None, str(data))
    path = data / KEY_FILE_NAME
    assert len(key) == 64 and path.read_bytes().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create(None, str(data)) == key  # a restart keeps its hashes comparable
    assert load_or_create(None, str(tmp_path / "other")) != key  # another deployment's


def test_a_given_file_wins_and_a_short_one_is_refused(tmp_path: Path) -> None:
    given = tmp_path / "secret"
    given.write_text("  a-shared-secret-of-the-deployment\n")
    key = load_or_create(str(given), str(tmp_path / "data"))
    assert key == b"a-shared-secret-of-the-deployment"
    assert not (tmp_path / "data" / KEY_FILE_NAME).exists()
    given.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        read_key(str(given))
    with pytest.raises(ValueError):
        Keyer(b"short")


def test_a_missing_key_file_is_a_configuration_error(tmp_path: Path) -> None:
    cfg = ServeConfig(endpoints=(f"ipc://{tmp_path}/p.sock",),
                      hash_key_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="hash key file"):
        cfg.validate()
