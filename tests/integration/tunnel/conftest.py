"""The tunnel integration tests' shared fixture: one server replica and one agent (the
harness's `Tunnel`), closed after the test. A module that needs another shape defines its
own `tunnel` fixture, which takes precedence."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.tunnel.harness import Tunnel


@pytest.fixture
async def tunnel(tmp_path: Path) -> AsyncIterator[Tunnel]:
    t = Tunnel(tmp_path)
    await t.start_server()
    await t.start_agent()
    try:
        yield t
    finally:
        await t.close()
