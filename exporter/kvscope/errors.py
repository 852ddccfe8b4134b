"""The one configuration error every kvscope command and the client SDK raise."""

from __future__ import annotations


class ConfigError(ValueError):
    """All problems found in one configuration."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(errors))
        self.errors = errors
