"""The one header rule book: which request headers never cross a Waygate hop.

Every HTTP path that forwards a client's request uses these rules: the proxy's
HTTP/1.1 parser (`waygate.proxy.http1`), its HTTP/2 streams, and the tunnel's
HTTPS front (`waygate.tunnel.front`). They drifted apart when each kept its
own list (the front forwarded `Proxy` and `X_Remote_User`, the proxy forwarded
`Impersonate-User` and `X-Forwarded-Client-Cert`); one list ends that.

Protocol rules only: core knows no service, so nothing here names a route or
a listener.

- `CLIENT_FORBIDDEN`: headers a client may never set, because a backend behind
  a front proxy trusts them as the proxy's own word: identity
  (X-Remote-User/-Group/-Extra-*, the kube-aggregator's front-proxy headers),
  impersonation (Impersonate-User/-Group/-Uid/-Extra-*, the Kubernetes API's),
  client-certificate headers (X-SSL-*, X-Client-Cert, X-Forwarded-Client-Cert,
  ingress-nginx's ssl-client-cert/-verify/-subject-dn/-issuer-dn),
  Waygate's own (X-Waygate-*), `Proxy` (httpoxy, CVE-2016-5385) and the
  underscore spellings of X-Forwarded-* (which a CGI/WSGI backend reads as the
  dashed ones). Names compare case-insensitively with `_` read as `-`:
  CGI/WSGI map X_Remote_User and X-Remote_User to the same HTTP_X_REMOTE_USER.
- `HOP_BY_HOP`: RFC 9110 section 7.6.1's connection-scoped headers (and the
  common non-standard ones), never forwarded as they came.
- HTTP/2 field rules (RFC 9113 sections 8.2.1, 8.2.2), the ones the proxy's
  h2 streams apply (`waygate.proxy.http2` read_request, check_trailers):
  `h2_illegal_name` / `h2_illegal_value` / `h2_legal_value` (bound regex
  searches, called once per field on the per-request path: no wrapper frame), `H2_CONNECTION_SPECIFIC`
  (a message carrying one is malformed), `h2_te_allowed` (a request's `te` is
  `trailers` only) and `h2_trailer_malformed` (a trailer field, all of them).

`CLIENT_FORBIDDEN_PATTERN` is the same rule as a regex fragment, so a parser
that splits a head in one C pass (http1) finds these names in that pass.
"""

from __future__ import annotations

import re
from typing import Final

_TCHAR: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_SEP: Final = rb"[-_]"

# The rule as a regex fragment over a whole field name (case-insensitive use:
# wrap it in (?i:...)). Every alternative consumes the name to its end, so a
# match followed by ':' is exactly a forbidden name.
CLIENT_FORBIDDEN_PATTERN: Final = (
    rb"proxy"
    rb"|x" + _SEP + rb"remote" + _SEP + rb"(?:user|group|extra" + _SEP + _TCHAR + rb"*+)"
    rb"|x" + _SEP + rb"ssl" + _SEP + _TCHAR + rb"*+"
    rb"|ssl" + _SEP + rb"client" + _SEP + _TCHAR + rb"*+"  # ingress-nginx's auth-tls headers
    rb"|x" + _SEP + rb"client" + _SEP + rb"cert" + _TCHAR + rb"*+"
    rb"|x" + _SEP + rb"forwarded" + _SEP + rb"client" + _SEP + rb"cert"
    rb"|impersonate" + _SEP + _TCHAR + rb"++"
    rb"|x" + _SEP + rb"waygate" + _SEP + _TCHAR + rb"++"
    # The forwarded family's underscore spellings (the dashed ones are the
    # proxy's to rewrite, not forbidden).
    rb"|x_forwarded" + _SEP + rb"(?:for|host|port|proto)"
    rb"|x-forwarded_(?:for|host|port|proto)"
)
_CLIENT_FORBIDDEN: Final = re.compile(rb"(?i:" + CLIENT_FORBIDDEN_PATTERN + rb")")

# Examples of every forbidden family, one spelling each way (tests iterate these).
CLIENT_FORBIDDEN_EXAMPLES: Final = (
    b"Proxy",
    b"X-Remote-User",
    b"X-Remote-Group",
    b"X-Remote-Extra-Scopes",
    b"X_Remote_User",
    b"X-Remote_Group",
    b"x_remote_extra_scopes",
    b"X-SSL-Client-Cert",
    b"X-SSL-Client-S-DN",
    b"X_SSL_Client_Verify",
    b"ssl-client-verify",
    b"SSL_Client_Cert",
    b"X-Client-Cert",
    b"X-Forwarded-Client-Cert",
    b"X_Forwarded_Client_Cert",
    b"Impersonate-User",
    b"Impersonate-Group",
    b"Impersonate-Uid",
    b"Impersonate-Extra-Scopes",
    b"Impersonate_User",
    b"X-Waygate-Route",
    b"X_Forwarded_For",
    b"X-Forwarded_Host",
)


def client_forbidden(name: bytes) -> bool:
    """Whether a client may not send header `name` (any case, `_` as `-`)."""
    return _CLIENT_FORBIDDEN.fullmatch(name) is not None


#: The same rule as a bound regex match (the match or None), for a per-field loop
#: (an HTTP/2 request's fields): no wrapper frame per field.
client_forbidden_match: Final = _CLIENT_FORBIDDEN.fullmatch


# RFC 9110 section 7.6.1 (and Keep-Alive, Proxy-Connection as sent in practice).
HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# RFC 9113 section 8.2.2: connection-specific fields make an HTTP/2 message malformed.
H2_CONNECTION_SPECIFIC: Final = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)

#: RFC 9113 section 8.2.1: a field name with one of these (upper case, controls,
#: SP, DEL, non-ASCII, a colon outside a pseudo-header) is malformed; the match or None.
h2_illegal_name: Final = re.compile(rb"[\x00-\x20A-Z\x7f-\xff:]").search
#: ... and a value with NUL, CR or LF anywhere, SP or HTAB at either end.
h2_illegal_value: Final = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z").search
#: The same rule the other way round (the match, or None for an illegal value):
#: one pass of a character class, half the cost of the search above per field.
h2_legal_value: Final = re.compile(rb"(?![ \t])[^\x00\r\n]*+(?<![ \t])").fullmatch


def h2_te_allowed(value: bytes) -> bool:
    """Whether a request's `te` field may stay (RFC 9113 section 8.2.2: "trailers" only,
    compared as it came: surrounding whitespace already makes the value illegal)."""
    return value.lower() == b"trailers"


def h2_trailer_malformed(name: bytes, value: bytes) -> bool:
    """Whether a trailer field makes an HTTP/2 message malformed: an empty or illegal
    name (a pseudo-header's colon included), an illegal value, a connection-specific
    field, or `te` at all (it belongs in the head)."""
    return (
        not name
        or h2_illegal_name(name) is not None
        or (bool(value) and h2_illegal_value(value) is not None)
        or name == b"te"
        or name in H2_CONNECTION_SPECIFIC
    )


def connection_named(values: list[bytes] | tuple[bytes, ...]) -> set[bytes]:
    """The header names a Connection header's values name (hop-by-hop too, RFC 9110
    section 7.6.1), lower-cased; `close`, `keep-alive`, `upgrade` are options, not names."""
    named = {t.strip().lower() for value in values for t in value.split(b",")}
    named -= {b"close", b"keep-alive", b"upgrade", b""}
    return named
