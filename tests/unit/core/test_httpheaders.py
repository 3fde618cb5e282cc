"""The header rule book's names: every forbidden family in any case and either
separator, and the look-alikes that stay allowed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waygate.core import httpheaders


@pytest.mark.parametrize("name", httpheaders.CLIENT_FORBIDDEN_EXAMPLES)
def test_forbidden_names_in_any_case(name: bytes) -> None:
    assert httpheaders.client_forbidden(name)
    assert httpheaders.client_forbidden(name.lower())
    assert httpheaders.client_forbidden(name.upper())


@pytest.mark.parametrize(
    "name",
    [
        b"X-Forwarded-For",
        b"Forwarded",
        b"Proxy-Status",
        b"X-Remote-Addr",
        b"Authorization",
        b"Impersonate",
        b"X-Waygate",
        b"Host",
        b"X-Client",
    ],
)
def test_look_alikes_stay_allowed(name: bytes) -> None:
    assert not httpheaders.client_forbidden(name)


def test_h2_field_rules() -> None:
    assert httpheaders.h2_te_allowed(b"Trailers")
    assert not httpheaders.h2_te_allowed(b"gzip")
    assert httpheaders.h2_illegal_name(b"Content-Type") is not None
    assert httpheaders.h2_illegal_name(b"x:y") is not None
    assert httpheaders.h2_illegal_name(b"content-type") is None
    assert httpheaders.h2_illegal_value(b" padded") is not None
    assert httpheaders.h2_illegal_value(b"a\nb") is not None
    assert httpheaders.h2_illegal_value(b"inner space ok") is None
    # Trailers: connection-specific fields and any `te` are malformed there.
    assert httpheaders.h2_trailer_malformed(b"connection", b"keep-alive")
    assert httpheaders.h2_trailer_malformed(b"te", b"trailers")
    assert httpheaders.h2_trailer_malformed(b":path", b"/")
    assert httpheaders.h2_trailer_malformed(b"", b"x")
    assert not httpheaders.h2_trailer_malformed(b"grpc-status", b"0")


def test_connection_named_headers() -> None:
    assert httpheaders.connection_named([b"keep-alive, X-Secret", b"close,Upgrade"]) == {
        b"x-secret"
    }


@given(st.binary(max_size=8) | st.sampled_from([b"", b" ", b"\t", b"a ", b"\ta", b"a\x00", b"a b"]))
def test_h2_legal_value_is_the_illegal_rule_turned_round(value: bytes) -> None:
    # read_request's one-pass form of the value rule: legal exactly when the
    # search finds nothing (an empty value is legal).
    illegal = bool(value) and httpheaders.h2_illegal_value(value) is not None
    assert (httpheaders.h2_legal_value(value) is None) == illegal
