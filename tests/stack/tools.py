"""The test tools ``scripts/install.sh --dev`` installs outside the venv, required as such.

A test that installed a missing tool itself would pass on a machine whose install script
lost that step, and CI runs the install script on a fresh machine exactly to find that:
a missing tool fails the test that needs it, saying which step installs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def require(path: Path, what: str) -> Path:
    """``path``, or a failure (never a skip) naming the tool and the install step."""
    if not path.exists():
        pytest.fail(f"{what} is not installed ({path.relative_to(ROOT)} is missing): "
                    "scripts/install.sh --dev installs it", pytrace=False)
    return path
