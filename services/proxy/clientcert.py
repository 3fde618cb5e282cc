"""ingress-nginx's client certificates (auth-tls-*), decided per request as nginx does.

The handshake side is `waygate.proxy.tls`: the route's host gets a context of
its own (its certificate, the route's CA bundle and revocation lists, a session
id context of its own), and the SNI callback asks that connection's client for
a certificate (`waygate.core.tls.ask_client_certificate`: OpenSSL verifies it
with the route's depth and keeps the verdict; the handshake never fails on it,
as nginx's never does). `decide(rules, ssl_object, rules_digest, host)` is the
request's part, once per connection and route (the connection caches it), for
HTTP/1.1 and HTTP/2 alike (the request core's `client_certificate` gate):

- on a connection whose TLS server name is not the route's host (an HTTP/2
  connection coalesced onto this host, an HTTP/1.1 Host that is not the
  server name, a session resumed from another host): 421 Misdirected Request,
  as nginx answers a request for a server with ssl_verify_client whose name
  is not the one negotiated (the client retries on a connection of its own).
  The SNI callback marks each session (its session id context, which OpenSSL
  keeps in the session) with a digest of the rules that act in the handshake
  (CA bundle, revocation lists, mode, depth) and of the server name; a
  wildcard route compares the rules' half only;
- verify "on" without a certificate: 400 "No required SSL certificate was
  sent"; a certificate that failed verification (any mode but "off"; with
  optional_no_ca only an untrusted issuer passes, as nginx's
  ngx_ssl_verify_error_optional): 400 "The SSL certificate error" — or a 302
  to auth-tls-error-page instead of either 400 (error_page 495 496);
- auth-tls-match-cn: an RE2 search of the subject DN (as nginx's
  `$ssl_client_s_dn !~ "CN=..."`, RFC 2253 form); no match, or no
  certificate: 403 "client certificate unauthorized";
- otherwise the header lines for the backend: ssl-client-verify (SUCCESS,
  NONE or FAILED:<reason>), ssl-client-subject-dn, ssl-client-issuer-dn and,
  with auth-tls-pass-certificate-to-upstream, ssl-client-cert (the PEM,
  URL-encoded as nginx's $ssl_client_escaped_cert). Empty values are not
  sent (nginx's proxy_set_header drops them); a client's own ssl-client-*
  headers never reach a backend (waygate.core.httpheaders).

On plain HTTP only auth-tls-match-cn applies (no certificate: 403). A host
whose auth-tls-* cannot be honoured (another Ingress's: the resolver's
`refusal`) answers every request 403, as ingress-nginx's server does.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Final
from urllib.parse import quote

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from waygate.core.regex import LinearPattern, RegexRefused, compile_linear
from waygate.core.tls import client_verify_result, verify_error_text
from waygate.resolver.client import ClientCertificate

KIND: Final = "client_certificate"
MISSING: Final = "No required SSL certificate was sent"
FAILED: Final = "The SSL certificate error"
UNAUTHORIZED: Final = "client certificate unauthorized"

# nginx's ngx_ssl_verify_error_optional: the errors optional_no_ca lets through
# (an issuer that is not trusted, or not found), by OpenSSL's X509_V_ERR_ numbers.
_UNTRUSTED_ISSUER: Final = frozenset((2, 18, 19, 20, 21, 27))
# OpenSSL's short names where cryptography's RFC 4514 output differs.
_OPENSSL_NAMES: Final = {
    NameOID.EMAIL_ADDRESS: "emailAddress",
    NameOID.SERIAL_NUMBER: "serialNumber",
    NameOID.STREET_ADDRESS: "street",
    NameOID.GIVEN_NAME: "GN",
    NameOID.SURNAME: "SN",
    NameOID.TITLE: "title",
    NameOID.POSTAL_CODE: "postalCode",
    NameOID.BUSINESS_CATEGORY: "businessCategory",
    NameOID.JURISDICTION_COUNTRY_NAME: "jurisdictionC",
}

# (status, reason): the request is answered (302: reason is the Location).
Refusal = tuple[int, str]


class Rules:
    """One route's auth-tls rules, compiled once per routing table."""

    __slots__ = ("error_page", "match", "pass_certificate", "refusal", "verify")

    def __init__(self, rules: ClientCertificate) -> None:
        self.refusal = rules.refusal
        self.verify = rules.verify
        self.error_page = rules.error_page
        self.pass_certificate = rules.pass_certificate
        self.match: LinearPattern | None = None
        if rules.match_subject:
            try:
                self.match = compile_linear(rules.match_subject)
            except RegexRefused:
                # The resolver checked it; should it still not compile, nothing matches.
                self.match = compile_linear("[^\\x00-\\x{10FFFF}]")

    def unauthorized(self, subject: str) -> bool:
        return self.match is not None and self.match.search(subject) is None

    def refuse(self, reason: str) -> Refusal:
        return (302, self.error_page) if self.error_page else (400, reason)


def applies(entry: Any) -> bool:
    """The request core's `applies` (once per table and route entry)."""
    access = entry.route.access
    return access is not None and access.client_certificate is not None


def on_plain_http(route: Any) -> Refusal | bytes:
    """A request on plain HTTP: only auth-tls-match-cn applies (no certificate: 403)."""
    return decide(rules_for(route.access.client_certificate), None, None)


#: Compiled once per distinct rules (a connection asks once per route), not per request.
rules_for = functools.lru_cache(maxsize=1024)(Rules)


def distinguished_name(name: x509.Name) -> str:
    """A DN as nginx's $ssl_client_s_dn (OpenSSL's RFC 2253 form): control and
    non-ASCII bytes as \\XX, so the value is a safe header value too."""
    text = name.rfc4514_string(_OPENSSL_NAMES)
    if text.isascii() and text.isprintable():
        return text
    return "".join(
        c if " " <= c <= "~" else "".join(f"\\{b:02X}" for b in c.encode()) for c in text
    )


#: A session's mark: the rules' digest, then the server name's (16 bytes each).
MARK_HALF: Final = 16


def session_mark(rules_digest: bytes, server_name: str) -> bytes:
    """What a session made for `server_name` under these rules is marked with (its
    session id context, set by the SNI callback: OpenSSL keeps it in the session)."""
    name = hashlib.sha256(server_name.lower().encode()).digest()
    return rules_digest + name[:MARK_HALF]


def decide(
    rules: Rules, ssl_object: Any, rules_digest: bytes | None, host: str = ""
) -> Refusal | bytes:
    """The request's verdict on its connection's certificate: a refusal, or the
    header lines the backend gets (see the module docstring). `rules_digest`: the
    session id context of the contexts verifying clients by these rules (None: the
    host's certificate is not served); `host`: the route's."""
    if rules.refusal:  # ingress-nginx's AuthTLSError: the server returns 403
        return 403, rules.refusal
    if ssl_object is None:  # plain HTTP: no certificate, no ssl-client-* values
        return (403, UNAUTHORIZED) if rules.match is not None else b""
    if rules.verify == "off":
        return (403, UNAUTHORIZED) if rules.match is not None else b"ssl-client-verify: NONE\r\n"
    if rules_digest is None:
        return 503, "the host's certificate is not served: no client certificate can be asked for"
    result = client_verify_result(ssl_object)
    if result is None:
        return 503, "client certificates cannot be read in this interpreter"
    code, sid = result
    if host.startswith("*."):  # any name under it (the request's is not known here)
        misdirected = sid[:MARK_HALF] != rules_digest
    else:
        misdirected = sid != session_mark(rules_digest, host)
    if misdirected:
        # The session (new or resumed) was made for another server name: nginx's 421
        # (its certificate, if any, may never have been verified by these rules).
        return 421, "the TLS session was made for another host: connect with this host's name"
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        if rules.verify == "on":
            return rules.refuse(MISSING)
        return (403, UNAUTHORIZED) if rules.match is not None else b"ssl-client-verify: NONE\r\n"
    if code and not (rules.verify == "optional_no_ca" and code in _UNTRUSTED_ISSUER):
        return rules.refuse(FAILED)
    try:
        leaf = x509.load_der_x509_certificate(der)
        subject = distinguished_name(leaf.subject)
        issuer = distinguished_name(leaf.issuer)
    except ValueError:  # OpenSSL took it (optional_no_ca), cryptography cannot read it
        return rules.refuse(FAILED)
    if rules.unauthorized(subject):
        return 403, UNAUTHORIZED
    verdict = "SUCCESS" if code == 0 else "FAILED:" + verify_error_text(code)
    lines = "ssl-client-verify: " + verdict + "\r\n"
    if subject:
        lines += "ssl-client-subject-dn: " + subject + "\r\n"
    if issuer:
        lines += "ssl-client-issuer-dn: " + issuer + "\r\n"
    if rules.pass_certificate:
        pem = leaf.public_bytes(Encoding.PEM).decode("ascii")
        lines += "ssl-client-cert: " + quote(pem, safe="") + "\r\n"
    return lines.encode("ascii")
