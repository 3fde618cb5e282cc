"""ingress-nginx's proxy-body-size (nginx's client_max_body_size), sans-IO.

A route's `max_request_body` (bytes; 0: no limit) bounds the request body:

- a Content-Length above it is answered 413 before anything is sent upstream
  (`too_large`, the request core's gate);
- a body without one (HTTP/1.1 chunked; HTTP/2 DATA without content-length)
  is counted as it streams: chunked bodies by the chunk sizes announced, as
  nginx counts them (so a chunk that would cross the limit is refused before
  its bytes are relayed), HTTP/2 DATA by payload. Crossing the limit before the
  backend answered: the upstream request is abandoned and the client answered
  413 (HTTP/1.1: the connection then closes, the rest of the body unread);
  after: the exchange is aborted, as any failure mid-response.

The limit is set on the Forward only for a request with a body to count, so
every other request reads one class attribute.
"""

from __future__ import annotations

KIND = "body_too_large"


def reason(limit: int) -> str:
    return f"request body larger than {limit} bytes (the route's proxy-body-size)"
