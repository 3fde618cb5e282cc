"""The server contexts' TLS groups (Mozilla intermediate) and the guarded ctypes
path that sets them: where the object layout is not known, nothing is written
and OpenSSL's default groups apply."""

from __future__ import annotations

import ssl
import sys
import sysconfig
from collections.abc import Iterator

import pytest

from tests.support.pki import LocalCA
from waygate.core import tls


@pytest.fixture(autouse=True)
def fresh_lookup() -> Iterator[None]:
    tls._ssl_ctx_functions.cache_clear()
    yield
    tls._ssl_ctx_functions.cache_clear()


def handshake(server: ssl.SSLContext, client_group: str) -> None:
    """A real TLS handshake over memory BIOs; the client offers one group only."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.set_ecdh_curve(client_group)
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname="a.test")
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        done = 0
        for side, out, peer_in in ((c, c_out, s_in), (s, s_out, c_in)):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            peer_in.write(out.read())
        if done == 2:
            return
    raise AssertionError("handshake did not finish")


def server() -> ssl.SSLContext:
    cert, key = LocalCA().issue(dns=["a.test"])
    return tls.server_context(chain_pem=cert, key_pem=key)


def test_server_contexts_refuse_groups_outside_mozilla_intermediate() -> None:
    handshake(server(), "prime256v1")
    with pytest.raises(ssl.SSLError):
        handshake(server(), "secp521r1")


@pytest.mark.parametrize("build", ["free-threaded", "trace-refs"])
def test_unknown_object_layouts_are_not_written_to(
    monkeypatch: pytest.MonkeyPatch, build: str
) -> None:
    if build == "free-threaded":
        real = sysconfig.get_config_var
        monkeypatch.setattr(
            sysconfig,
            "get_config_var",
            lambda name: 1 if name == "Py_GIL_DISABLED" else real(name),
        )
    else:
        monkeypatch.setattr(sys, "gettotalrefcount", lambda: 0, raising=False)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    assert not tls._set_groups(context, b"X25519")
    handshake(server(), "secp521r1")  # OpenSSL's default groups apply


def test_only_ssl_contexts_are_read() -> None:
    assert not tls._set_groups(object(), b"X25519")  # type: ignore[arg-type]
    assert tls._set_groups(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), b"X25519")
