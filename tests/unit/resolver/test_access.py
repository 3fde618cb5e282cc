"""Who may call the write RPCs: identity patterns, matching, fail-closed lists."""

from __future__ import annotations

from pathlib import Path

import pytest

from waygate.core.errors import PermissionDenied
from waygate.core.identity import matches, pattern_problem
from waygate.core.settings import SettingsError, load_settings
from waygate.resolver.access import WriteAccess
from waygate.resolver.app import Settings

SA = "spiffe://waygate.local/ns/local/sa/"


@pytest.mark.parametrize(
    ("pattern", "identity", "expected"),
    [
        (SA + "user", SA + "user", True),
        (SA + "user", SA + "user2", False),
        (SA + "tunnel-*", SA + "tunnel-server", True),
        (SA + "tunnel-*", SA + "proxy", False),
        ("spiffe://waygate.local/ns/local/*", SA + "anything", True),
        ("spiffe://waygate.local/ns/local/*", "spiffe://waygate.local/ns/other/sa/x", False),
        ("ops.example.com", "OPS.Example.com", True),
        ("ops.example.com", "ops.example.com.evil.test", False),
        ("ops.example.com", "spiffe://ops.example.com", False),
    ],
)
def test_matching(pattern: str, identity: str, expected: bool) -> None:
    assert pattern_problem(pattern) is None
    assert matches(pattern, identity) is expected


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("spiffe://waygate.local/*/sa/user", "only at the end"),
        ("https://example.com/user", "only spiffe://"),
        ("*.example.com", "neither"),
        ("bad_name", "neither"),
        ("spiffe://Bad Domain/x", "not a SPIFFE ID"),
    ],
)
def test_bad_patterns_are_named(pattern: str, reason: str) -> None:
    problem = pattern_problem(pattern)
    assert problem is not None and reason in problem and repr(pattern) in problem


def test_without_client_certificates_writes_are_open_and_said_so() -> None:
    access = WriteAccess()
    access.check_route_admin("ApplyRoute", ())
    access.check_tunnel_reporter(())
    assert access.unauthenticated_warning and "ApplyRoute" in access.unauthenticated_warning


def test_with_mtls_an_empty_list_refuses_everyone() -> None:
    access = WriteAccess(route_admins=(SA + "user",), authenticated=True)
    access.check_route_admin("ApplyRoute", (SA + "user",))
    assert access.unauthenticated_warning is None
    with pytest.raises(PermissionDenied, match=f"ReportTunnels: '{SA}user' may not"):
        access.check_tunnel_reporter((SA + "user",))
    with pytest.raises(PermissionDenied, match="without identities"):
        access.check_route_admin("DeleteRoute", ())


def test_settings_read_comma_separated_identities(tmp_path: Path) -> None:
    settings = load_settings(
        Settings,
        flags={"route_admins": f"{SA}user, ops.example.com"},
        env={"WAYGATE_TUNNEL_REPORTERS": SA + "tunnel-*"},
    )
    assert settings.route_admins == (SA + "user", "ops.example.com")
    assert settings.tunnel_reporters == (SA + "tunnel-*",)
    with pytest.raises(SettingsError, match="route_admins") as info:
        load_settings(Settings, flags={"route_admins": "https://x.example.com/"}, env={})
    assert "\n" not in str(info.value)


def test_up_limits_writes_to_the_tunnel_server_and_the_user(tmp_path: Path) -> None:
    from waygate.components import UpContext
    from waygate.resolver.app import up_arguments

    argv = up_arguments(UpContext(state_dir=tmp_path, port_offset=0))
    assert argv[argv.index("--tunnel-reporters") + 1] == SA + "tunnel-server"
    assert argv[argv.index("--route-admins") + 1] == SA + "user"


def test_route_keys_only_to_route_readers_and_never_without_identities() -> None:
    access = WriteAccess(route_readers=(SA + "proxy",), authenticated=True)
    assert access.may_read_route_keys((SA + "proxy",))
    assert not access.may_read_route_keys((SA + "user",))
    assert not access.may_read_route_keys((SA + "proxy2",))
    assert not access.may_read_route_keys(())
    assert not WriteAccess(authenticated=True).may_read_route_keys((SA + "proxy",)), "empty: nobody"
    # A listener without client certificates has no identities: keys stay home.
    plaintext = WriteAccess(route_readers=(SA + "proxy",), authenticated=False)
    assert not plaintext.may_read_route_keys((SA + "proxy",))
    settings = load_settings(Settings, flags={"route_readers": SA + "proxy"}, env={})
    assert settings.route_readers == (SA + "proxy",)
    with pytest.raises(SettingsError, match="route_readers"):
        load_settings(Settings, flags={"route_readers": "spiffe://x/*/y"}, env={})


def test_a_refusal_repeats_the_peer_identities_only_as_an_excerpt() -> None:
    """A certificate with thousands of SANs: every one was echoed in the status."""
    access = WriteAccess(route_admins=(SA + "admin",), authenticated=True)
    many = tuple(f"spiffe://x/ns/n/sa/{'a' * 50}{i}" for i in range(5000))
    with pytest.raises(PermissionDenied) as info:
        access.check_route_admin("ApplyRoute", many)
    assert len(str(info.value)) < 600
    assert "characters)" in str(info.value)


def test_listener_reports_come_from_route_readers_only() -> None:
    access = WriteAccess(route_readers=(SA + "proxy",), authenticated=True)
    access.check_listener_reporter((SA + "proxy",))
    with pytest.raises(PermissionDenied) as caught:
        access.check_listener_reporter((SA + "user",))
    assert "ReportListeners" in str(caught.value) and "--route-readers" in str(caught.value)


def test_backend_certificate_reports_come_from_route_readers_only() -> None:
    access = WriteAccess(route_readers=(SA + "proxy",), authenticated=True)
    access.check_backend_certificate_reporter((SA + "proxy",))
    with pytest.raises(PermissionDenied) as caught:
        access.check_backend_certificate_reporter((SA + "user",))
    assert "ReportBackendCertificates" in str(caught.value)


def test_the_reason_route_keys_are_withheld_is_named() -> None:
    """Issue 29 finding 9: the Watch client hears why it gets no keys."""
    proxy = "spiffe://waygate.local/ns/local/sa/proxy"
    readers = WriteAccess(route_readers=(proxy,), authenticated=True)
    assert readers.route_keys_withheld((proxy,)) == ""
    assert (
        readers.route_keys_withheld(("spiffe://waygate.local/ns/local/sa/user",))
        == "identity 'spiffe://waygate.local/ns/local/sa/user' is not in --route-readers"
    )
    assert readers.route_keys_withheld(()) == "the client certificate names no identity"
    plaintext = WriteAccess(route_readers=(proxy,), authenticated=False)
    assert plaintext.route_keys_withheld((proxy,)) == "this connection to the resolver is not mTLS"
