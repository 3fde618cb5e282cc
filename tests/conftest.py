"""Suite-wide pytest hooks: the long tests start first.

`make test` runs two xdist workers, and the suite ends when the slower one does: a
test of a minute or more collected late (the soak, the ten-thousand-dial leak test,
three CA rotations under load) leaves the other worker idle at the end. The long
tests say so by their pytest-timeout mark (300 s or more); run first, the short
tests fill in around them. The order among the long ones, and among the rest, is
collection order.
"""

from __future__ import annotations

import pytest

LONG_TIMEOUT = 300


def _long(item: pytest.Item) -> bool:
    mark = item.get_closest_marker("timeout")
    return bool(mark and mark.args and mark.args[0] >= LONG_TIMEOUT)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not _long(item))  # stable: long ones first, in order
