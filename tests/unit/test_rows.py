"""The stored rows' constructors: what ``dataclass`` would build, set faster, still frozen."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvscope.rows import TABLES


def sample(f: dataclasses.Field[Any], i: int) -> Any:
    """A value of ``f``'s type that differs from field to field (bools alternate)."""
    kind = str(f.type)
    if kind.startswith("list"):
        return [i, i + 1]
    return {"float": i + 0.5, "int": i + 7, "bool": i % 2 == 0}.get(kind, f"v{i}")


@pytest.mark.parametrize("table", sorted(TABLES))
def test_a_row_holds_what_it_was_given_and_its_defaults_and_stays_frozen(table: str) -> None:
    cls = TABLES[table]
    fs = dataclasses.fields(cls)
    values = {f.name: sample(f, i) for i, f in enumerate(fs)}
    by_name = cls(**values)
    by_position = cls(*values.values())
    assert {f.name: getattr(by_name, f.name) for f in fs} == values
    assert by_position == by_name
    if not any(isinstance(v, list) for v in values.values()):
        assert hash(by_position) == hash(by_name)
    required = {f.name: values[f.name] for f in fs if f.default is dataclasses.MISSING}
    bare = cls(**required)
    for f in fs:
        assert getattr(bare, f.name) == (values[f.name] if f.name in required else f.default)
    with pytest.raises(dataclasses.FrozenInstanceError):
        by_name.ts = 0.0
    with pytest.raises(TypeError):
        cls(**required, no_such_column=1)
    with pytest.raises(TypeError):
        cls()
