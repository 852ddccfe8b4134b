"""The units of work of the README's ``pytest -n 2 --dist loadgroup`` (tests/conftest.py):
the engine tests one unit, every other module one each."""

from __future__ import annotations

from tests.conftest import ENGINE_TESTS, xdist_group


def test_engine_tests_are_one_unit_and_every_other_module_its_own() -> None:
    engine = [f"{ENGINE_TESTS}shared/test_engine.py::test_a",
              f"{ENGINE_TESTS}test_many_servers.py::test_b[x@y]",
              f"{ENGINE_TESTS}test_demo_engine.py::test_c"]
    assert {xdist_group(n) for n in engine} == {"vllm-server"}
    assert xdist_group("tests/unit/test_cli.py::test_a") == "tests/unit/test_cli.py"
    assert xdist_group("tests/unit/test_cli.py::K::test_b[1]") == "tests/unit/test_cli.py"
    assert xdist_group("tests/twin/test_demo.py::test_a") == "tests/twin/test_demo.py"
