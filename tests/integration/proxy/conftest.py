"""Fixtures shared by the proxy's integration tests (a test module's own fixture of the
same name takes precedence)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.proxyharness import RecordingUpstream


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    """A recording upstream on port 0, stopped afterwards."""
    server = await RecordingUpstream().start()
    yield server
    await server.stop()
