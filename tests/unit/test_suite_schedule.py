"""The suite's own schedule (tests/conftest.py): the longest bound first, a ``mostly_waits`` test
as if its bound were MOSTLY_WAITS_BOUND_S, the random order kept within a bound. Checked on
stand-in items given to the real hook that pytest loaded for this run."""

from __future__ import annotations

from pathlib import Path

import pytest

SUITE_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


class _Item:
    """What the hook reads of a test: its id, its marks (no fixtures of its own module)."""

    def __init__(self, name: str, timeout: float | None = None, waits: bool = False) -> None:
        self.nodeid = f"tests/x/test_{name}.py::test_{name}"
        self.name = name
        self._marks = {}
        if timeout is not None:
            self._marks["timeout"] = pytest.mark.timeout(timeout).mark
        if waits:
            self._marks["mostly_waits"] = pytest.mark.mostly_waits.mark

    def get_closest_marker(self, name: str):
        return self._marks.get(name)

    def add_marker(self, marker) -> None:
        raise AssertionError(f"{self.name} has no module fixture to group by")


@pytest.fixture
def suite(pytestconfig):
    for plugin in pytestconfig.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) == str(SUITE_CONFTEST):
            return plugin
    raise AssertionError(f"{SUITE_CONFTEST} is not loaded")


def _order(suite, items: list[_Item]) -> list[str]:
    suite.pytest_collection_modifyitems(None, items)
    return [i.name for i in items]


def test_a_long_test_that_mostly_waits_starts_after_the_other_long_ones(suite):
    items = [_Item("sleeper", 1200, waits=True), _Item("quick"), _Item("cpu600", 600),
             _Item("demo", 1860), _Item("cpu900", 900), _Item("short", 300)]
    # Scheduled as a 600 s test: after the 900 s one, before the other 600 s one that came later.
    assert _order(suite, items) == ["demo", "cpu900", "sleeper", "cpu600", "short", "quick"]
    assert suite.MOSTLY_WAITS_BOUND_S == 600


def test_a_short_test_that_mostly_waits_keeps_its_own_bound(suite):
    items = [_Item("a", 120, waits=True), _Item("b", 300), _Item("c", 120)]
    assert _order(suite, items) == ["b", "a", "c"]
