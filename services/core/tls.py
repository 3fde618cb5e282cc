"""`ssl` server contexts: the one builder, and contexts that follow rotation.

This module knows `ssl` and the rotation client's certificate holders, nothing
else: no grpc (gRPC credentials and channel rotation are in
`waygate.core.grpctls`), no certs API (the certs client is `waygate.certs.client`).

- `server_context`: THE builder of every server `ssl.SSLContext` in Waygate
  (HTTPS listeners, the proxy's route and default certificates, the tunnel
  front, static tls_* files). TLS 1.2+, Mozilla "intermediate" ciphers and
  groups (X25519, P-256, P-384: set through OpenSSL's SSL_CTX_ctrl, which
  Python's ssl does not expose). It refuses client authentication without a CA
  to check clients against: a service that requires client certificates never
  silently serves without them.
- A narrower policy per context (ingress-nginx's ssl-protocols and ssl-ciphers):
  `server_context(minimum_version=, ciphers=)`, checked by `policy_problem`
  (never below TLS 1.2; an OpenSSL cipher list only, no configuration text).
  A context switched to by an SNI callback brings its cipher list, not its
  versions (OpenSSL has chosen the version before the callback runs), so the
  callback checks `negotiated_version` against the context's minimum. A host
  served with another context (its certificate refused or its key withheld)
  keeps its policy all the same: `set_connection_ciphers` on the connection.
- `ServerSSLContexts`: an `ssl.SSLContext` for asyncio HTTPS listeners whose
  SNI callback (run for every ClientHello, with or without SNI) switches the
  connection to the context built from the current certificate.

Session resumption without long-lived ticket keys: Python's `ssl` cannot set
or rotate session-ticket keys, and OpenSSL encrypts tickets with a key of the
listener's context, made once and kept for the listener's whole life (an SNI
callback switching contexts does not change it). A ticket key that never
rotates would undo forward secrecy for every resumed session, so every context
built here sets OP_NO_TICKET: TLS 1.2 resumes by session id and TLS 1.3 gets
OpenSSL's stateful tickets, both from the listener's in-memory session cache.

Invariants: the private key is given to OpenSSL in memory (an anonymous memfd,
never a file on disk), and every context built here refuses anything older
than TLS 1.2.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import ssl
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from waygate.core.rotation import CertificateRotator, HeldCertificate, TrustStore

log = logging.getLogger(__name__)

# Mozilla's "intermediate" configuration (v5.7): TLS 1.2 suites, in order; TLS 1.3
# suites are OpenSSL's defaults, which are exactly Mozilla's list.
INTERMEDIATE_CIPHERS = ":".join(
    (
        "ECDHE-ECDSA-AES128-GCM-SHA256",
        "ECDHE-RSA-AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305",
        "ECDHE-RSA-CHACHA20-POLY1305",
        "DHE-RSA-AES128-GCM-SHA256",
        "DHE-RSA-AES256-GCM-SHA384",
        "DHE-RSA-CHACHA20-POLY1305",
    )
)
# Mozilla intermediate groups. Python's ssl can set one ECDH curve at most
# (`set_ecdh_curve`), so the list goes to OpenSSL directly (`_set_groups`).
INTERMEDIATE_GROUPS = b"X25519:P-256:P-384"
_SSL_CTRL_SET_GROUPS_LIST = 92

ClientAuth = Literal["none", "optional", "required"]

#: The TLS versions Waygate serves, by the names nginx's ssl_protocols uses.
VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLSv1.2": ssl.TLSVersion.TLSv1_2,
    "TLSv1.3": ssl.TLSVersion.TLSv1_3,
}
# An OpenSSL cipher list: names, `!`/`-`/`+` prefixes, `:`/`,` separators and
# @STRENGTH (never @SECLEVEL: the security level is OpenSSL's own).
_CIPHER_LIST = re.compile(
    r"(?:[A-Za-z0-9_.+!-]+|@STRENGTH)(?:[:, ](?:[A-Za-z0-9_.+!-]+|@STRENGTH))*"
)
MAX_CIPHER_LIST = 2048


def policy_problem(protocols: tuple[str, ...] | list[str], ciphers: str) -> str:
    """Why a context cannot be built with these versions and TLS 1.2 ciphers ("" : it
    can). Versions are TLSv1.2 and TLSv1.3 only and must include TLSv1.3 (the version
    is chosen before an SNI callback picks the host's context, so a host cannot be
    held to TLS 1.2: it can only refuse what is older than its minimum). The cipher
    list must parse and leave at least one TLS 1.2 suite."""
    for name in protocols:
        if name not in VERSIONS:
            return f"protocol {name!r} is not served (only TLSv1.2 and TLSv1.3)"
    if protocols and "TLSv1.3" not in protocols:
        return "TLSv1.3 must be served (the version is chosen before the host is known)"
    if ciphers:
        if len(ciphers) > MAX_CIPHER_LIST or not _CIPHER_LIST.fullmatch(ciphers):
            return "not an OpenSSL cipher list (names, !, -, +, : separators)"
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            probe.set_ciphers(ciphers)
        except ssl.SSLError:
            return "OpenSSL selects no cipher from this list"
        if not any(c["protocol"] == "TLSv1.2" for c in probe.get_ciphers()):
            return "the list selects no TLS 1.2 cipher suite"
    return ""


def minimum_version(protocols: tuple[str, ...] | list[str]) -> ssl.TLSVersion:
    """The oldest of `protocols` (checked by `policy_problem`); TLS 1.2 when empty."""
    return min((VERSIONS[name] for name in protocols), default=ssl.TLSVersion.TLSv1_2)


def load_pem_chain(context: ssl.SSLContext, chain_pem: bytes, key_pem: bytes) -> None:
    """Give OpenSSL a key through an anonymous in-memory file (it only reads paths)."""
    with _memory_file(chain_pem + key_pem) as path:
        context.load_cert_chain(path)


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path OpenSSL can read `data` from: an anonymous memfd, else a 0600 file in a
    0700 temporary directory (removed on exit)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("waygate-tls", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "tls.pem"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        yield str(path)


def _layout_is_known() -> bool:
    """Whether an `ssl.SSLContext` object is laid out as `_set_groups` reads it:
    CPython's PySSLContext is the object header (refcount, type) then the SSL_CTX
    pointer. Free-threaded builds (Py_GIL_DISABLED) have a larger header, and
    Py_TRACE_REFS builds (debug builds: sys.gettotalrefcount) two more pointers."""
    return (
        sys.implementation.name == "cpython"
        and not sysconfig.get_config_var("Py_GIL_DISABLED")
        and not hasattr(sys, "gettotalrefcount")
    )


@functools.cache
def _ssl_ctx_functions() -> tuple[Any, Any] | None:
    """SSL_CTX_ctrl and SSL_CTX_get_options from the libssl `_ssl` uses (looked up
    once), or None where `_set_groups` must not read the object (see above)."""
    if not _layout_is_known():
        return None
    try:
        libssl = ctypes.CDLL(ssl._ssl.__file__)  # type: ignore[attr-defined]
        ctrl = libssl.SSL_CTX_ctrl
        get_options = libssl.SSL_CTX_get_options
    except (OSError, AttributeError):
        return None
    ctrl.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_char_p)
    ctrl.restype = ctypes.c_long
    get_options.argtypes = (ctypes.c_void_p,)
    get_options.restype = ctypes.c_uint64
    return ctrl, get_options


def _ssl_ctx_pointer(context: ssl.SSLContext, get_options: Any) -> int | None:
    """The context's SSL_CTX pointer (CPython keeps it right after the object header), or
    None unless the SSL_CTX there reports the context's own options: a layout this code
    does not know is never written through."""
    header = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)
    ssl_ctx = ctypes.c_void_p.from_address(id(context) + header).value
    if not ssl_ctx or get_options(ssl_ctx) != int(context.options):
        return None
    return int(ssl_ctx)


def _on_ssl_ctx(context: ssl.SSLContext, call: Callable[[Any, int], Any]) -> bool:
    """`call(SSL_CTX_ctrl, the context's SSL_CTX pointer)`; False, with nothing called,
    where the SSL_CTX cannot be reached: not CPython, a free-threaded or Py_TRACE_REFS
    build, no such symbols, or a layout this code does not know (`_ssl_ctx_pointer`)."""
    functions = _ssl_ctx_functions()
    if functions is None or not isinstance(context, ssl.SSLContext):
        return False
    ctrl, get_options = functions
    try:
        ssl_ctx = _ssl_ctx_pointer(context, get_options)
        if ssl_ctx is None:
            return False
        return call(ctrl, ssl_ctx) is not False
    except (OSError, AttributeError, ValueError):
        return False


def _set_groups(context: ssl.SSLContext, groups: bytes) -> bool:
    """SSL_CTX_set1_groups_list on the context's SSL_CTX. False, and OpenSSL's default
    groups (sslyze would then report the groups beyond Mozilla intermediate's), where
    that is not possible (`_on_ssl_ctx`) or OpenSSL refuses the list."""
    return _on_ssl_ctx(
        context, lambda ctrl, ssl_ctx: ctrl(ssl_ctx, _SSL_CTRL_SET_GROUPS_LIST, 0, groups) == 1
    )


_SSL_CTRL_SET_SESS_CACHE_SIZE = 42


@functools.cache
def _shutdown_functions() -> tuple[Any, Any, Any, Any] | None:
    """SSL_shutdown, SSL_get_error, SSL_get_SSL_CTX and ERR_clear_error from the libssl
    `_ssl` uses, or None (as `_ssl_ctx_functions`)."""
    if _ssl_ctx_functions() is None:
        return None
    try:
        libssl = ctypes.CDLL(ssl._ssl.__file__)  # type: ignore[attr-defined]
        functions = (
            libssl.SSL_shutdown,
            libssl.SSL_get_error,
            libssl.SSL_get_SSL_CTX,
            libssl.ERR_clear_error,
        )
    except (OSError, AttributeError):
        return None
    shutdown, get_error, get_ctx, clear = functions
    shutdown.argtypes = (ctypes.c_void_p,)
    shutdown.restype = ctypes.c_int
    get_error.argtypes = (ctypes.c_void_p, ctypes.c_int)
    get_error.restype = ctypes.c_int
    get_ctx.argtypes = (ctypes.c_void_p,)
    get_ctx.restype = ctypes.c_void_p
    clear.argtypes = ()
    clear.restype = None
    return functions


def _ssl_pointer(sock: ssl.SSLSocket) -> int | None:
    """The SSL pointer of a socket-BIO connection (CPython's _ssl._SSLSocket keeps it after
    the object header and a weak reference), or None unless the SSL there belongs to the
    socket's own context's SSL_CTX: a layout this code does not know is never used."""
    functions, ctx_functions = _shutdown_functions(), _ssl_ctx_functions()
    sslobj = getattr(sock, "_sslobj", None)
    if functions is None or ctx_functions is None or sslobj is None:
        return None
    header = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)
    pointer = ctypes.c_void_p.from_address(id(sslobj) + header + ctypes.sizeof(ctypes.c_void_p))
    ssl_ctx = _ssl_ctx_pointer(sock.context, ctx_functions[1])
    if not pointer.value or ssl_ctx is None or functions[2](pointer.value) != ssl_ctx:
        return None
    return int(pointer.value)


@functools.cache
def can_send_close_notify() -> bool:
    """Whether `send_close_notify` works in this interpreter (see `_ssl_pointer`): tried
    once on a throw-away connection that never handshakes."""
    if _shutdown_functions() is None:
        return False
    import socket

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    left, right = socket.socketpair()
    try:
        with context.wrap_socket(left, server_hostname="x", do_handshake_on_connect=False) as s:
            return _ssl_pointer(s) is not None
    finally:
        right.close()


_SSL_ERROR_WANT_WRITE = 3


def send_close_notify(sock: ssl.SSLSocket) -> bool | None:
    """One SSL_shutdown on a non-blocking socket-BIO connection: sends close_notify (this
    side's direction only) without waiting for the peer's. `SSLSocket.unwrap` calls
    SSL_shutdown a second time, which reads the socket for the peer's close_notify and
    throws away application data it meets there; a half-closed connection goes on
    reading. True once sent, False when the socket could not take it yet (call again
    once it is writable: OpenSSL resends the pending alert), None where the SSL cannot
    be reached or OpenSSL failed (the caller aborts)."""
    ssl_pointer = _ssl_pointer(sock)
    functions = _shutdown_functions()
    if ssl_pointer is None or functions is None:
        return None
    shutdown, get_error, _get_ctx, clear = functions
    result = shutdown(ssl_pointer)
    if result >= 0:
        return True
    error = get_error(ssl_pointer, result)
    clear()  # nothing of ours left in the thread's error queue for `ssl` to misreport
    return False if error == _SSL_ERROR_WANT_WRITE else None


def set_session_cache_size(context: ssl.SSLContext, size: int) -> bool:
    """SSL_CTX_sess_set_cache_size (Python's ssl does not expose it): OpenSSL keeps up to
    20,480 sessions per server context by default, several KiB each, which a listener
    taking a new TLS connection per tunnelled connection fills in minutes. False where
    the context cannot be reached (see `_set_groups`); the default then applies."""
    return _on_ssl_ctx(
        context, lambda ctrl, ssl_ctx: ctrl(ssl_ctx, _SSL_CTRL_SET_SESS_CACHE_SIZE, size, None)
    )


@functools.cache
def _libssl_function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """One function of the libssl `_ssl` uses, typed, or None (as `_ssl_ctx_functions`)."""
    if _ssl_ctx_functions() is None:
        return None
    try:
        function = getattr(ctypes.CDLL(ssl._ssl.__file__), name)  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


def _set_timeout_function() -> Any:
    """SSL_CTX_set_timeout, or None (see `_libssl_function`)."""
    return _libssl_function("SSL_CTX_set_timeout", (ctypes.c_void_p, ctypes.c_long), ctypes.c_long)


def set_session_timeout(context: ssl.SSLContext, seconds: int) -> bool:
    """SSL_CTX_set_timeout (Python's ssl does not expose it): how long a server context
    resumes a session (OpenSSL's default is 7,200 s). A resumed handshake checks no
    certificate, so this bounds how long a peer whose certificate expired or whose CA
    left the trust bundle can still resume. False where the context cannot be reached
    (as `set_session_cache_size`)."""
    set_timeout = _set_timeout_function()
    if set_timeout is None:
        return False
    return _on_ssl_ctx(context, lambda _ctrl, ssl_ctx: set_timeout(ssl_ctx, seconds))


# ---------------------------------------------------------------- client certificates per SSL
# nginx's way (ngx_http_ssl_servername, ngx_http_process_request), which Python's
# `ssl` cannot express: the SNI callback sets the connection's own verify mode and
# depth for the host it chose, OpenSSL's verification never ends the handshake (the
# callback accepts every certificate) and the request reads the verdict it kept.

_SSL_VERIFY_PEER = 1
_CRL_CHECK, _CRL_CHECK_ALL = 0x4, 0x8  # X509_V_FLAG_CRL_CHECK, X509_V_FLAG_CRL_CHECK_ALL
_VerifyCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
# Keeps every verdict for the request (nginx's ngx_ssl_verify_callback returns 1 too).
_ACCEPT_FOR_LATER = _VerifyCallback(lambda _ok, _store: 1)


@functools.cache
def _client_verify_functions() -> dict[str, Any] | None:
    """SSL_set_verify, SSL_set_verify_depth, SSL_get_verify_result, SSL_get_session,
    SSL_SESSION_get0_id_context, SSL_SESSION_set1_id_context, SSL_session_reused,
    SSL_get0_param, X509_VERIFY_PARAM_set_flags, SSL_CTX_set_session_id_context,
    X509_verify_cert_error_string, SSL_load_client_CA_file and SSL_CTX_set_client_CA_list
    from the libssl
    `_ssl` uses, or None (as `_ssl_ctx_functions`)."""
    if _ssl_ctx_functions() is None:
        return None
    c = ctypes
    signatures = {
        "SSL_set_verify": ((c.c_void_p, c.c_int, _VerifyCallback), None),
        "SSL_set_verify_depth": ((c.c_void_p, c.c_int), None),
        "SSL_get_verify_result": ((c.c_void_p,), c.c_long),
        "SSL_get_session": ((c.c_void_p,), c.c_void_p),
        "SSL_SESSION_get0_id_context": ((c.c_void_p, c.POINTER(c.c_uint)), c.c_void_p),
        "SSL_SESSION_set1_id_context": ((c.c_void_p, c.c_char_p, c.c_uint), c.c_int),
        "SSL_session_reused": ((c.c_void_p,), c.c_int),
        "SSL_get0_param": ((c.c_void_p,), c.c_void_p),
        "X509_VERIFY_PARAM_set_flags": ((c.c_void_p, c.c_ulong), c.c_int),
        "SSL_CTX_set_session_id_context": ((c.c_void_p, c.c_char_p, c.c_uint), c.c_int),
        "X509_verify_cert_error_string": ((c.c_long,), c.c_char_p),
        "SSL_load_client_CA_file": ((c.c_char_p,), c.c_void_p),
        "SSL_CTX_set_client_CA_list": ((c.c_void_p, c.c_void_p), None),
    }
    try:
        libssl = ctypes.CDLL(ssl._ssl.__file__)  # type: ignore[attr-defined]
        functions = {name: getattr(libssl, name) for name in signatures}
    except (OSError, AttributeError):
        return None
    for name, (argtypes, restype) in signatures.items():
        functions[name].argtypes = argtypes
        functions[name].restype = restype
    return functions


def _set_session_id_context(context: ssl.SSLContext, sid: bytes) -> bool:
    functions = _client_verify_functions()
    if functions is None or not 0 < len(sid) <= 32:
        return False
    set_sid = functions["SSL_CTX_set_session_id_context"]
    return _on_ssl_ctx(context, lambda _ctrl, ssl_ctx: set_sid(ssl_ctx, sid, len(sid)) == 1)


def _advertise_client_cas(context: ssl.SSLContext, ca_pem: bytes) -> bool:
    """SSL_CTX_set_client_CA_list: the certificate request names the CAs (as nginx's
    ssl_client_certificate does), so a browser offers only certificates they issued."""
    functions = _client_verify_functions()
    ctx_functions = _ssl_ctx_functions()
    if functions is None or ctx_functions is None:
        return False
    ssl_ctx = _ssl_ctx_pointer(context, ctx_functions[1])
    if ssl_ctx is None:
        return False
    with _memory_file(ca_pem) as path:
        names = functions["SSL_load_client_CA_file"](path.encode())
    if not names:
        return False
    functions["SSL_CTX_set_client_CA_list"](ssl_ctx, names)  # the context owns them now
    return True


def ask_client_certificate(
    ssl_object: Any, depth: int, session_id_context: bytes, *, revocation: bool = False
) -> bool:
    """From an SNI callback, after switching `ssl_object` to its host's context: ask
    this connection's client for a certificate, verified against that context's CAs
    with at most `depth` intermediates (and, with `revocation`, its revocation lists
    for every CA of the chain: the verify flags, as the depth, are the connection's
    own from the listener's context), the verdict kept for the request
    (`client_verify_result`) instead of ending the handshake; a new session is marked
    with `session_id_context` (OpenSSL made it, and looks sessions up to resume,
    under the listener's context, before this callback: a session so marked is
    never resumed, and one resumed here keeps the mark of the context it was made
    under). False where the connection cannot be reached (see `_ssl_pointer`)."""
    functions = _client_verify_functions()
    pointer = _ssl_pointer(ssl_object) if functions is not None else None
    if functions is None or pointer is None:
        return False
    functions["SSL_set_verify"](pointer, _SSL_VERIFY_PEER, _ACCEPT_FOR_LATER)
    functions["SSL_set_verify_depth"](pointer, depth)
    if revocation:
        param = functions["SSL_get0_param"](pointer)
        functions["X509_VERIFY_PARAM_set_flags"](param, _CRL_CHECK | _CRL_CHECK_ALL)
    session = functions["SSL_get_session"](pointer)
    if session and not functions["SSL_session_reused"](pointer):
        sid = session_id_context
        functions["SSL_SESSION_set1_id_context"](session, sid, len(sid))
    return True


def negotiated_version(ssl_object: Any) -> int | None:
    """The protocol version OpenSSL chose for this connection (0x0303 TLS 1.2, 0x0304
    TLS 1.3: `ssl.TLSVersion` values), readable from an SNI callback (Python's
    `version()` says None until the handshake is done); None where the connection
    cannot be reached (see `_ssl_pointer`)."""
    function = _libssl_function("SSL_version", (ctypes.c_void_p,), ctypes.c_int)
    pointer = _ssl_pointer(ssl_object) if function is not None else None
    if function is None or pointer is None:
        return None
    return int(function(pointer))


def set_connection_ciphers(ssl_object: Any, ciphers: str) -> bool:
    """From an SNI callback: this connection's TLS 1.2 cipher list (checked by
    `policy_problem`), whatever its context's (OpenSSL picks the suite after the
    callback). False where the connection cannot be reached or OpenSSL refuses it."""
    function = _libssl_function(
        "SSL_set_cipher_list", (ctypes.c_void_p, ctypes.c_char_p), ctypes.c_int
    )
    pointer = _ssl_pointer(ssl_object) if function is not None else None
    if function is None or pointer is None:
        return False
    return bool(function(pointer, ciphers.encode("ascii")) == 1)


def client_verify_result(ssl_object: Any) -> tuple[int, bytes] | None:
    """(OpenSSL's verify result, X509_V_OK being 0; the session id context the
    connection's session was made under) after the handshake, or None where it
    cannot be read."""
    functions = _client_verify_functions()
    pointer = _ssl_pointer(ssl_object) if functions is not None else None
    if functions is None or pointer is None:
        return None
    session = functions["SSL_get_session"](pointer)
    sid = b""
    if session:
        length = ctypes.c_uint(0)
        data = functions["SSL_SESSION_get0_id_context"](session, ctypes.byref(length))
        sid = ctypes.string_at(data, length.value) if data else b""
    return int(functions["SSL_get_verify_result"](pointer)), sid


def verify_error_text(code: int) -> str:
    """OpenSSL's words for a verify result (nginx's "FAILED:<reason>")."""
    functions = _client_verify_functions()
    text = functions["X509_verify_cert_error_string"](code) if functions is not None else None
    return text.decode("ascii", "replace") if text else f"error {code}"


def load_certificate_chain(context: ssl.SSLContext, held: HeldCertificate) -> None:
    load_pem_chain(context, held.chain_pem(), held.key_pem())


def server_context(
    *,
    chain_pem: bytes,
    key_pem: bytes,
    client_ca_pem: bytes | None = None,
    client_auth: ClientAuth | bool = "none",
    alpn_protocols: tuple[str, ...] = (),
    client_crl_pem: bytes | None = None,
    session_id_context: bytes = b"",
    advertise_client_cas: bool = False,
    minimum_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2,
    ciphers: str = "",
) -> ssl.SSLContext:
    """A server context for one certificate (the only builder of server contexts).

    `client_auth` "required" (or True) demands a client certificate chaining to
    `client_ca_pem`; "optional" asks for one and verifies it when sent (the proxy's
    per-route client CAs decide afterwards). Either without a CA raises ValueError.
    `client_crl_pem`: revocation lists every CA of a client's chain needs one of
    (nginx's ssl_crl: OpenSSL's CRL_CHECK and CRL_CHECK_ALL). `session_id_context`:
    sessions made under this context resume under it only (OpenSSL compares it when
    resuming; CPython gives every context the same one); ValueError when it cannot
    be set. `advertise_client_cas`: the certificate request names `client_ca_pem`'s
    CAs (best effort: without, clients send what they have all the same).
    `minimum_version` (TLS 1.2 or newer) and `ciphers` (TLS 1.2 suites, an OpenSSL
    list; empty: Mozilla intermediate's) narrow the policy; ValueError for a wider one.
    """
    mode: ClientAuth = (
        ("required" if client_auth else "none") if isinstance(client_auth, bool) else client_auth
    )
    if mode != "none" and not client_ca_pem:
        raise ValueError("client authentication needs a client CA to verify clients against")
    if minimum_version < ssl.TLSVersion.TLSv1_2:
        raise ValueError("Waygate serves TLS 1.2 and newer only")
    problem = policy_problem((), ciphers)
    if problem:
        raise ValueError(f"ciphers: {problem}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = minimum_version
    context.set_ciphers(ciphers or INTERMEDIATE_CIPHERS)
    # The server picks the suite (Mozilla intermediate: client preference is fine too,
    # but the server order puts AES-GCM and ECDSA first).
    context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_COMPRESSION
    context.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_TICKET
    if not _set_groups(context, INTERMEDIATE_GROUPS):
        log.debug("could not restrict TLS groups; OpenSSL's defaults apply")
    load_pem_chain(context, chain_pem, key_pem)
    if mode != "none":
        assert client_ca_pem is not None
        context.load_verify_locations(cadata=client_ca_pem.decode())
        context.verify_mode = ssl.CERT_REQUIRED if mode == "required" else ssl.CERT_OPTIONAL
        if client_crl_pem:
            # OpenSSL reads CRLs from files only: an anonymous in-memory one.
            with _memory_file(client_crl_pem) as path:
                context.load_verify_locations(cafile=path)
            context.verify_flags |= ssl.VERIFY_CRL_CHECK_CHAIN
        if advertise_client_cas and not _advertise_client_cas(context, client_ca_pem):
            log.debug("could not name the client CAs in certificate requests")
    if session_id_context and not _set_session_id_context(context, session_id_context):
        raise ValueError("the TLS session id context cannot be set in this interpreter")
    if alpn_protocols:
        context.set_alpn_protocols(list(alpn_protocols))
    return context


def server_ssl_context(
    held: HeldCertificate,
    client_ca_pem: bytes | None = None,
    *,
    client_auth: bool = False,
    alpn_protocols: tuple[str, ...] = (),
) -> ssl.SSLContext:
    """`server_context` for a rotation client's certificate."""
    return server_context(
        chain_pem=held.chain_pem(),
        key_pem=held.key_pem(),
        client_ca_pem=client_ca_pem,
        client_auth=client_auth,
        alpn_protocols=alpn_protocols,
    )


class ServerSSLContexts:
    """`context` for an asyncio TLS listener that always serves the current certificate.

    A new per-certificate context is built once per rotation (or bundle
    change), not per handshake; the listener's context only dispatches to it
    from its SNI callback, which OpenSSL runs for every ClientHello.
    """

    def __init__(
        self,
        rotator: CertificateRotator,
        trust: TrustStore | None = None,
        *,
        client_auth: bool = False,
        alpn_protocols: tuple[str, ...] = (),
    ) -> None:
        if client_auth and trust is None:
            raise ValueError("client_auth needs a trust store")
        self._rotator = rotator
        self._trust = trust
        self._client_auth = client_auth
        self._alpn = alpn_protocols
        self._current = self._build()
        self.context = self._build()
        self.context.sni_callback = self._on_client_hello
        self._unsubscribe = [rotator.subscribe(lambda _held: self._rebuild())]
        if trust is not None:
            self._unsubscribe.append(trust.subscribe(lambda _bundle: self._rebuild()))

    @property
    def current(self) -> ssl.SSLContext:
        return self._current

    def close(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()

    def _build(self) -> ssl.SSLContext:
        return server_ssl_context(
            self._rotator.current,
            self._trust.current.pem if (self._trust is not None and self._client_auth) else None,
            client_auth=self._client_auth,
            alpn_protocols=self._alpn,
        )

    def _rebuild(self) -> None:
        self._current = self._build()

    def _on_client_hello(
        self, ssl_object: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: Any
    ) -> None:
        ssl_object.context = self._current


__all__ = [
    "INTERMEDIATE_CIPHERS",
    "ServerSSLContexts",
    "load_certificate_chain",
    "load_pem_chain",
    "server_context",
    "server_ssl_context",
]
