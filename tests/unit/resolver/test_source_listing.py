"""How the CLI words a route source's state (issue 29 finding 1): each kind of
source by its name, a rejected file or a failing Kubernetes source with its
error, since when, and what to do."""

from __future__ import annotations

from datetime import UTC, datetime

from waygate.resolver import convert
from waygate.resolver.commands import format_sources
from waygate.resolver.model import SourceState

LOADED = datetime(2026, 12, 7, 14, 0, tzinfo=UTC)
SINCE = datetime(2026, 12, 7, 14, 5, tzinfo=UTC)


def listing(*states: SourceState) -> str:
    return format_sources([convert.source_state_to_proto(s) for s in states])


def test_each_source_is_named_and_its_state_said() -> None:
    text = listing(
        SourceState("file:/s/routes.yaml", True, loaded_version=3, loaded_at=LOADED),
        SourceState(
            "manifests:/s/gateway.yaml",
            False,
            "/s/gateway.yaml:12: bad regex",
            loaded_version=3,
            loaded_at=LOADED,
            error_since=SINCE,
        ),
        SourceState(
            "kubernetes",
            False,
            "endpointslices: 503 unavailable",
            loaded_version=2,
            loaded_at=LOADED,
            error_since=SINCE,
        ),
    )
    assert text.splitlines() == [
        "routes file /s/routes.yaml: valid (version 3 loaded 2026-12-07T14:00:00Z)",
        "manifests /s/gateway.yaml: REJECTED: /s/gateway.yaml:12: bad regex",
        "  serving the last good content (version 3 loaded 2026-12-07T14:00:00Z; failing since "
        "2026-12-07T14:05:00Z); fix that line and it reloads",
        "kubernetes: FAILING: endpointslices: 503 unavailable",
        "  serving the last good content (version 2 loaded 2026-12-07T14:00:00Z; failing since "
        "2026-12-07T14:05:00Z); see the resolver's log; it retries with backoff",
    ]
