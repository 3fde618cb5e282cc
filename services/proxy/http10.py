"""ingress-nginx's proxy-http-version "1.0" in the request core (sans-IO, pure on bytes).

nginx's `proxy_http_version 1.0` (ngx_http_proxy_module), which ingress-nginx renders
for the annotation, seen on the wire from nginx 1.22 (request bytes recorded by a
backend):

- the request line says HTTP/1.0 and the head carries `Connection: close` (nginx's
  own default Connection header; `request_head`);
- nothing chunked goes to the backend: a request body of unknown length (chunked
  from an HTTP/1.1 client, an HTTP/2 request without content-length) is taken in
  whole first, whatever proxy-request-buffering says (nginx buffers a chunked body
  for HTTP/1.0 even with `proxy_request_buffering off`), and sent with its
  Content-Length (`buffered_head`; the Exchange's chunked reader hands the request
  buffer the bare payload). A body whose client expects 100-continue is buffered
  too: the proxy sends the 100 itself, as nginx does; an HTTP/1.0 backend never
  would. A body past the buffers' bound is answered 413 with the reason
  (`bodybuffer`), as nginx answers 413 past client_max_body_size;
- the connection carries that one exchange and is closed after it
  (`upstream_h1.SingleUseConnection`), and a 1.0 request looks for an idle one
  under a pool key nothing is put under (`exchange.Exchange.dispatch`), so it never
  takes an idle keep-alive connection either;
- the answer is read as the backend sends it: an HTTP/1.0 answer without
  Content-Length runs to the close (`http1.response_framing`);
- an upgrade (WebSocket) is refused with 502 and the reason (`upgrade_refused`):
  HTTP/1.0 has no Upgrade (RFC 9110 section 7.8: a server ignores Upgrade in an
  HTTP/1.0 request). nginx would send the Upgrade header in the 1.0 request, which
  a conforming backend ignores; the client is told why instead;
- an HTTP/2 backend (backend-protocol GRPC, GRPCS, or an h2 Service) is unaffected.

Two rules of `decision`: a gate (`upgrade_refused`) and a shaper (`shape`), for the
routes with `upstream_http10` only (`applies`), so a route without it pays nothing
per request; `decide` turns the head it built into HTTP/1.0 (`request_head`) when
the shaper marked the request (`Forward.http10`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from waygate.proxy.http1 import RequestHead
    from waygate.proxy.routing import RouteEntry

KIND = "upgrade_to_http10"

_CHUNKED = b"\r\nTransfer-Encoding: chunked\r\n"
_CLOSE = b"Connection: close\r\n\r\n"


def applies(entry: RouteEntry) -> bool:
    """Whether a route sends HTTP/1.0 to (some of) its backends."""
    return entry.route.upstream_http10 and any(not b.http2 for b in entry.backends)


def upgrade_refused(upgrade: bytes) -> str:
    """Why an upgrade request of such a route is refused (502: `decision`'s gate)."""
    return (
        "the route sends HTTP/1.0 to its backend (proxy-http-version 1.0): an upgrade to "
        + upgrade.decode("ascii", "replace")
        + " cannot be relayed"
    )


def shape(forward: Any, req: RequestHead, facts: Any) -> None:
    """The shaper: an HTTP/1.1 backend gets HTTP/1.0; a body of unknown length is
    buffered whole first (its length is sent with it)."""
    if forward.http2:
        return
    forward.http10 = True
    if req.chunked or req.expect_continue:
        # (100-continue: the proxy invites the body itself, as nginx; an HTTP/1.0
        # backend sends no 100, RFC 9110 section 10.1.1.)
        forward.buffer_body = True


def request_head(head: bytes, chunked: bool) -> bytes:
    """`http1.build_upstream_head`'s HTTP/1.1 head as HTTP/1.0: the version, no chunked
    coding (its Content-Length comes with the buffered body: `buffered_head`),
    `Connection: close`."""
    end = head.index(b"\r\n")
    line = head[:end]
    if line.endswith(b" HTTP/1.1"):
        line = line[:-9] + b" HTTP/1.0"
    rest = head[end:-2]
    if chunked:
        rest = rest.replace(_CHUNKED, b"\r\n", 1)
    return line + rest + _CLOSE


def buffered_head(forward: Any, head: bytes, buffer: Any) -> bytes:
    """The head of a request whose body was buffered whole (`buffer`, a
    `bodybuffer.BodyBuffer`): for HTTP/1.0, a chunked one's gets the body's length
    (the Exchange's chunked reader gave the buffer the bare payload)."""
    if forward is not None and forward.http10 and forward.req.chunked:
        return head[:-2] + b"Content-Length: %d\r\n\r\n" % buffer.size
    return head
