"""Resolver settings: defaults, cross-field checks, and what `waygate up` passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from waygate.core.settings import SettingsError, load_settings
from waygate.resolver.app import Settings


def test_defaults_are_the_documented_ports() -> None:
    settings = load_settings(Settings, env={})
    assert (settings.grpc_port, settings.admin_port) == (7001, 9001)
    assert settings.routes_file is None and not settings.kubernetes
    assert (settings.tunnel_lease_min, settings.tunnel_lease, settings.tunnel_lease_max) == (
        5.0,
        30.0,
        300.0,
    )


def test_env_and_flags(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text("routes: []\n")
    settings = load_settings(
        Settings,
        flags={"tunnel_lease": "1m"},
        env={"WAYGATE_ROUTES_FILE": str(routes), "WAYGATE_WATCH_HISTORY": "50"},
    )
    assert settings.routes_file == routes and settings.watch_history == 50
    assert settings.tunnel_lease == 60.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"routes_file": "/nonexistent/routes.yaml"}, "is not a readable file"),
        ({"tunnel_lease": "1s"}, "tunnel_lease: must lie between"),
        ({"kubernetes": "true", "routes_file": "{routes}"}, "give one source, not both"),
        ({"kube_namespace": "shop"}, "need --kubernetes"),
        ({"watch_history": "0"}, "watch_history"),
        ({"watch_heartbeat": "-1s"}, "watch_heartbeat"),
    ],
)
def test_bad_settings_are_one_line_errors(
    tmp_path: Path, flags: dict[str, str], message: str
) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text("routes: []\n")
    flags = {k: v.format(routes=routes) for k, v in flags.items()}
    with pytest.raises(SettingsError, match=message) as info:
        load_settings(Settings, flags=flags, env={})
    assert "\n" not in str(info.value)


def test_up_copies_the_example_routes_file_0600(tmp_path: Path) -> None:
    """The copy is what ApplyRoute writes route TLS private keys into."""
    from waygate.components import UpContext
    from waygate.resolver.app import up_arguments
    from waygate.resolver.filesource import EXAMPLE_ROUTES

    argv = up_arguments(UpContext(state_dir=tmp_path / "state", port_offset=0))
    routes = tmp_path / "state" / "routes.yaml"
    assert argv[argv.index("--routes-file") + 1] == str(routes)
    assert routes.read_bytes() == EXAMPLE_ROUTES.read_bytes()
    assert routes.stat().st_mode & 0o777 == 0o600


def test_watch_bounds_never_exceed_what_clients_receive() -> None:
    """--max-message-bytes 16MiB made 14 MiB Changes events that clients, which
    receive at most 4 MiB, refused again on every resume."""
    from waygate.core.grpcclient import CLIENT_RECEIVE_BYTES
    from waygate.resolver.app import watch_bounds

    for limit in (1 << 20, 4 << 20, 16 << 20, 1 << 30):
        chunk, event = watch_bounds(limit)
        assert 0 < chunk < event < min(limit, CLIENT_RECEIVE_BYTES)


def test_up_serves_a_gateway_manifest_to_the_demo_backend_at_the_port_offset(tmp_path) -> None:
    from waygate.components import UpContext
    from waygate.resolver.app import up_arguments
    from waygate.resolver.manifests import parse_manifests

    argv = up_arguments(UpContext(state_dir=tmp_path / "state", port_offset=100))
    manifests = tmp_path / "state" / "gateway.yaml"
    assert argv[argv.index("--manifests") + 1] == str(manifests)
    content = parse_manifests([(manifests, manifests.read_text())])
    (route,) = content.routes
    assert route.host == "gateway.localtest.me" and route.listener_port == 80
    (endpoint,) = content.endpoints
    assert endpoint.ports[0].port == 8090 + 100
    assert [s.ports[0].target_port for s in content.services] == ["8190"]
