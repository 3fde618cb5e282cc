"""Property tests of the request head split: whatever mix and spelling of header
names a client sends, the proxy forwards exactly the lines it does not read, as
sent and in order, and never one of the lines it must drop.

The reference here is the plain rule, one header at a time (lower-case the name,
read '_' as '-' for identity lookalikes, look it up); the parser under test
finds the read headers with one case-insensitive regex split instead."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from waygate.proxy import http1

DROPPED = [
    "Connection",
    "Keep-Alive",
    "Proxy-Connection",
    "Proxy-Authorization",
    "TE",
    "Trailer",
    "Upgrade",
    "Proxy",
    "X-Remote-User",
    "X_Remote_Group",
    "X-SSL-Client-Cert",
    "x_ssl_verify",
    "X-Remote-Extra-Scopes",
    "X_Forwarded_For",
    "X-Forwarded_Host",
]
FORWARDED_FAMILY = ["X-Forwarded-For", "X-Forwarded-Proto", "Forwarded"]
ORDINARY = [
    "Accept",
    "User-Agent",
    "X-Request-Id",
    "Hostname",
    "X-Remote-Users",
    "X-SSLx",
    "Content-Type",
    "Tee",
    "Proxy-Info",
    "Upgrade-Insecure-Requests",
    "X-Forwarded-Server",
]


def spelled(name: str) -> st.SearchStrategy[str]:
    """The name in a random mix of upper and lower case."""
    return st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda flips: "".join(
            c.upper() if up else c.lower() for c, up in zip(name, flips, strict=True)
        )
    )


values = st.text(alphabet="abcXYZ019 ,;=/-", max_size=12).map(lambda v: v.strip())
fields = st.lists(
    st.one_of(
        st.tuples(st.just("dropped"), st.sampled_from(DROPPED).flatmap(spelled), values),
        st.tuples(st.just("family"), st.sampled_from(FORWARDED_FAMILY).flatmap(spelled), values),
        st.tuples(st.just("ordinary"), st.sampled_from(ORDINARY).flatmap(spelled), values),
    ),
    max_size=12,
)


@given(fields=fields, host_at=st.integers(min_value=0, max_value=12), host=spelled("Host"))
def test_forwarded_lines_are_exactly_the_unread_ones_in_order(
    fields: list[tuple[str, str, str]], host_at: int, host: str
) -> None:
    lines = [f"{name}: {value}" for _, name, value in fields]
    lines.insert(min(host_at, len(lines)), f"{host}: example.test")
    head = ("GET / HTTP/1.1\r\n" + "".join(line + "\r\n" for line in lines) + "\r\n").encode()
    request = http1.parse_request_head(head)
    forwarded = request.fields.split(b"\r\n")[:-1]
    expected = [f"{host}: example.test".encode()] + [
        f"{name}: {value}".encode() for kind, name, value in fields if kind == "ordinary"
    ]
    assert forwarded == expected
    assert request.host == b"example.test"
    assert [(lname, name) for lname, name, _ in request.forwarded] == [
        (name.lower().encode(), name.encode()) for kind, name, _ in fields if kind == "family"
    ]
