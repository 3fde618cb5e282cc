"""Every documented ingress-nginx annotation: its grammar and Waygate's verdict today.

Learned from kubernetes/ingress-nginx (docs/user-guide/nginx-configuration/
annotations.md and internal/ingress/annotations/, controller v1.15): the names,
the value types and the defaults. Nothing here is rendered into configuration
text: a value is checked against its grammar, then `annotations.py` turns it
into route fields (or a refusal).

Invariants:
- A value never passes with a newline, `;`, `{`, `}`, `#`, a quote, a backslash
  or `$` unless its grammar names that character (the IngressNightmare class of
  injection: CVE-2025-1097, -1098, -24514, -1974).
- `verdict` is what Waygate does TODAY with a valid value used as documented;
  `annotations.py` may only lower it for particular values (AJP backends,
  `ewma`), never raise it.
- `access` marks the annotations that bear on who may reach the backend: one of
  those not honoured makes the Ingress not served (fail closed).
- `proxy_lacks`: not honoured only because the proxy has no per-request
  behaviour for it yet (the list the request core is scheduled from).
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_PREFIX = "nginx.ingress.kubernetes.io"


class Verdict(enum.Enum):
    HONOURED = "honoured"
    DIFFERENT = "honoured-with-difference"
    NOOP = "no-op"
    NOT_HONOURED = "not-honoured"


# ---------------------------------------------------------------- grammars

# A grammar returns None for a valid value, else why not (for people).
Grammar = Callable[[str], "str | None"]

_FORBIDDEN = re.compile(r"[\r\n;{}#'\"`\\$]")
_BOOLS = frozenset(
    ("true", "false", "1", "0", "t", "f", "TRUE", "FALSE", "True", "False", "T", "F")
)
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_HEADER = re.compile(r"[A-Za-z0-9_.-]{1,256}")
_HOST = re.compile(
    r"(\*\.)?[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*"
)
_SIZE = re.compile(r"\d{1,12}[bkmgBKMG]?")
_PATH_CHARS = re.compile(r"/[A-Za-z0-9._~!*+,=:@%/-]*")
_URL = re.compile(r"https?://[A-Za-z0-9.-]+(:\d{1,5})?(/[A-Za-z0-9._~!*+,=:@%/&?-]*)?")
# A header value: printable ASCII, no quotes or separators of configuration text.
_VALUE = re.compile(r"[A-Za-z0-9 ._~!*+,=:@%/&?()\[\]<>|^-]{0,1024}")


def plain(value: str) -> str | None:
    """Any text without configuration syntax (the base every other grammar adds to)."""
    found = _FORBIDDEN.search(value)
    if found:
        return f"{found.group()!r} is not allowed here"
    if len(value) > 4096:
        return "longer than 4096 characters"
    return None


def _matching(pattern: re.Pattern[str], description: str) -> Grammar:
    def check(value: str) -> str | None:
        return None if pattern.fullmatch(value) else f"must be {description}"

    return check


def boolean(value: str) -> str | None:
    return None if value in _BOOLS else "must be true or false"


def integer(value: str) -> str | None:
    return None if re.fullmatch(r"-?\d{1,9}", value) else "must be an integer"


def seconds(value: str) -> str | None:
    """nginx timeouts as ingress-nginx takes them: whole seconds."""
    return None if re.fullmatch(r"\d{1,7}", value) else "must be a number of seconds"


def one_of(*values: str, case: bool = True) -> Grammar:
    allowed = frozenset(values if case else (v.lower() for v in values))

    def check(value: str) -> str | None:
        found = value if case else value.lower()
        return None if found in allowed else "must be one of " + ", ".join(values)

    return check


def cidrs(value: str) -> str | None:
    for item in value.split(","):
        try:
            ipaddress.ip_network(item.strip(), strict=False)
        except ValueError:
            return f"{item.strip()!r} is not an address or CIDR"
    return None


def hosts(value: str) -> str | None:
    for item in value.split(","):
        item = item.strip()
        if not _HOST.fullmatch(item) or len(item) > 253:
            return f"{item!r} is not a host name"
    return None


def headers(value: str) -> str | None:
    for item in value.split(","):
        if not _HEADER.fullmatch(item.strip()):
            return f"{item.strip()!r} is not a header name"
    return None


def path(value: str) -> str | None:
    """An absolute path of plain characters (no query, no configuration syntax)."""
    return None if _PATH_CHARS.fullmatch(value) else "must be an absolute path of plain characters"


def rewrite_target(value: str) -> str | None:
    """A path that may name capture groups ($1..$9), as ingress-nginx's RegexPathWithCapture."""
    bare = re.sub(r"\$[1-9]", "", value)
    if not bare.startswith("/"):
        bare = "/" + bare
    return path(bare)


def url(value: str) -> str | None:
    if not _URL.fullmatch(value):
        return "must be an http(s) URL of plain characters"
    # ingress-nginx's parser.StringToURL: "invalid url host".
    if ".." in value.split("://", 1)[1].split("/", 1)[0]:
        return "invalid url host (..)"
    return None


def mirror_url(value: str) -> str | None:
    """An http(s) URL in which nginx variables may stand ($request_uri is the one
    filled in: `annotations` reports any other as not honoured)."""
    return url(re.sub(r"\$[a-z_]{1,32}", "/x", value))


def signin_url(value: str) -> str | None:
    """An http(s) URL; `$host` and `$escaped_request_uri` are the only variables
    (filled in by the proxy, never rendered)."""
    return url(value.replace("$host", "host").replace("$escaped_request_uri", "uri"))


def url_or_path(value: str) -> str | None:
    return url(value) if "://" in value else path(value)


def name(value: str) -> str | None:
    """A Kubernetes object name, or NAMESPACE/NAME."""
    parts = value.split("/")
    if len(parts) > 2 or not all(_NAME.fullmatch(p) for p in parts):
        return "must be a Kubernetes object name (or NAMESPACE/NAME)"
    return None


def regex(value: str) -> str | None:
    """A regular expression: configuration syntax still refused (braces only as
    counted repetition, `$` only as an anchor)."""
    bare = re.sub(r"\{\d{1,4}(,\d{0,4})?\}", "", value)
    bare = re.sub(r"\$(?=$|[)|])", "", bare)
    bare = re.sub(r"\\[dDwWsSbB.\-/()\[\]*+?|^]", "", bare)
    problem = plain(bare)
    if problem:
        return problem
    try:
        re.compile(value)
    except re.error as exc:
        return f"is not a regular expression ({exc})"
    return None


def header_value(value: str) -> str | None:
    return None if _VALUE.fullmatch(value) else "must be plain printable text"


_SPAN_TEMPLATE = re.compile(r"[A-Za-z0-9 ._~!*+,=:@%/&?()\[\]<>|^$-]{1,256}")


def span_template(value: str) -> str | None:
    """opentelemetry-operation-name: printable text and `$name` variables (which
    ones are filled in is the annotation's handler's to say); never configuration."""
    if value == "":
        return None
    if not _SPAN_TEMPLATE.fullmatch(value) or re.search(r"\$(?![a-z_])", value):
        return "must be printable text with $variables, at most 256 characters"
    return None


def size(value: str) -> str | None:
    return None if _SIZE.fullmatch(value) else "must be a size such as 8k or 1m"


def status_codes(value: str) -> str | None:
    for item in value.split(","):
        if not re.fullmatch(r"[1-5]\d\d", item.strip()):
            return f"{item.strip()!r} is not an HTTP status code"
    return None


def any_text(value: str) -> str | None:
    """Snippets: their own parser decides (`annotations.snippet`); only the size is bounded."""
    return None if len(value) <= 65536 else "longer than 64 KiB"


def origins(value: str) -> str | None:
    for item in value.split(","):
        item = item.strip()
        if item != "*" and not re.fullmatch(r"https?://(\*\.)?[A-Za-z0-9.-]+(:\d{1,5})?", item):
            return f"{item!r} is not an origin"
    return None


def methods(value: str) -> str | None:
    for item in value.split(","):
        if not re.fullmatch(r"[A-Za-z]{1,20}", item.strip()):
            return f"{item.strip()!r} is not a method"
    return None


_CACHE_KEY = re.compile(
    r"(?:[A-Za-z0-9_.:/-]|\$(?:http_[a-z0-9_]{1,64}|cookie_[A-Za-z0-9_]{1,64}|remote_addr"
    r"|remote_user|host))"
    r"{1,256}"
)


def cache_key(value: str) -> str | None:
    """Literal text and the variables the proxy fills in: $http_NAME, $cookie_NAME,
    $remote_addr, $remote_user, $host (nothing is rendered into configuration)."""
    if _CACHE_KEY.fullmatch(value):
        return None
    return "must be text and $http_NAME, $cookie_NAME, $remote_addr, $remote_user or $host"


def cache_duration(value: str) -> str | None:
    """nginx proxy_cache_valid entries, comma-separated: status codes and a time."""
    for item in value.split(","):
        if not re.fullmatch(r"(\d{3} )*\d+[smhd]?", item.strip()):
            return "must be status codes and a duration such as '200 202 10m, 401 5m'"
    return None


# ---------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Entry:
    name: str  # without the prefix
    grammar: Grammar
    verdict: Verdict
    note: str  # the difference, why it is a no-op, or what is missing
    access: bool = False
    proxy_lacks: bool = False


def _e(
    name: str,
    grammar: Grammar,
    verdict: Verdict,
    note: str = "",
    *,
    access: bool = False,
    lacks: bool = False,
) -> Entry:
    return Entry(name, grammar, verdict, note, access, lacks)


H, D, N, X = Verdict.HONOURED, Verdict.DIFFERENT, Verdict.NOOP, Verdict.NOT_HONOURED
_PROXY_REDIRECT = (
    "nginx proxy_redirect on the backend's Location and Refresh: `off`, `default` (its "
    "pattern is ingress-nginx's internal upstream URL, which no backend sends: nothing "
    "rewritten) or a literal prefix and its replacement (one starting with / made "
    "absolute); regular expressions (~) are not honoured"
)
_PROXY_COOKIE = (
    "nginx proxy_cookie_domain / proxy_cookie_path on Set-Cookie: `off` or a literal "
    "`FROM TO`; regular expressions (~) and variables are not honoured"
)
_BUFFER = "an nginx buffer knob: the proxy streams bodies through bounded buffers of its own"
_AUTH = (
    "every request is first asked of the auth service (nginx auth_request): 2xx lets it "
    "through, 401 (with its WWW-Authenticate) and 403 answer the client, anything else 500; "
    "its Set-Cookie goes with the backend's 2xx/3xx answers and the sign-in redirect"
)
_ALWAYS_COOKIE = (
    "the auth service's Set-Cookie with every answer (add_header ... always): the "
    "backend's errors and the proxy's own 401/403/500 too"
)
#: auth-url (and global-auth-url) to an https:// service: the verdict's difference.
AUTH_URL_TLS = (
    "the https:// auth service's certificate is verified against the system trust store "
    "(TLS 1.2+, its host name): nginx's proxy_pass does not verify it, so a service with a "
    "certificate no public CA signed answers 500 here"
)
_KEEPALIVE = "the subrequest's connection is the proxy's own"
_AUTH_CACHE = (
    "answers kept per Ingress path and key, bounded in entries and bytes, as nginx's "
    "proxy_cache keeps them: GET/HEAD subrequests only; X-Accel-Expires, Cache-Control, "
    "Expires before the duration; never an answer with Set-Cookie or Vary: *"
)
_BASIC = (
    "basic: 401 with WWW-Authenticate, hashes verified exactly (bcrypt, apr1/MD5, {SHA}, "
    "{SSHA}, {PLAIN}; another format refuses the Ingress); digest: as nginx-http-auth-digest "
    "(MD5, qop=auth, user:realm:HA1 lines, its nonce lifetimes, replay and evasion rules, "
    "Authentication-Info); auth-realm off (or none for digest) refuses the Ingress: nginx "
    "would leave it open; the Authorization header is not passed to the backend, as "
    "ingress-nginx clears it"
)
#: auth-type digest's verdict note (annotations lower auth-* to DIFFERENT for it).
DIGEST_DIFFERENCE = (
    "digest as nginx-http-auth-digest (MD5, qop=auth, user:realm:HA1 lines, its nonce "
    "lifetimes, replay and evasion rules, Authentication-Info; the backend does not get "
    "Authorization); one difference: a nonce this proxy worker does not hold (another "
    "worker's, or forgotten when the bounded table was full) answered with the right "
    "password gets a stale challenge, which a browser answers without asking its user (the "
    "module: a plain one)"
)
_RANGES = (
    "403 outside the allowed / inside the denied ranges; the client address is the "
    "peer's, or with use-forwarded-headers X-Forwarded-For's through proxy-real-ip-cidr"
)
_LIMIT = "global rate limits (memcached, across replicas): the proxy limits per replica only"
_LIMITED = (
    "per proxy replica, keyed by the client address (nginx limit_req nodelay, limit_conn); "
    "with --workers N each worker process keeps its own counts"
)
_LIMIT_RATE = (
    "a response's body paced to the client (nginx's limit_rate in KB/s after "
    "limit_rate_after KB, the first second's worth at once), per response as nginx's; "
    "the head's bytes are not counted (nginx counts them)"
)
_WAF = "ModSecurity/OWASP CRS: Waygate has no web application firewall"
_CORS = "CORS headers on allowed origins' answers; preflights (OPTIONS) answered 204 by the proxy"
_MIRROR = (
    "a copy of each request to the URL, fire and forget (never waited for: nginx's "
    "mirror delays the request until the copy is answered), at most 32 in flight per "
    "route; a body goes with the copy when it was buffered (proxy-request-buffering, "
    "the default) and is at most 64 KiB, else the copy is not sent; a URL without a path "
    "gets `/` (nginx: its internal location name)"
)
_CANARY = (
    "folded into the main Ingress's route and decided per request as ingress-nginx's "
    "balancer: the sticky cookie, then the header, then the cookie, then the weight"
)

ENTRIES: tuple[Entry, ...] = (
    # ------------------------------------------------------------ paths
    _e(
        "use-regex",
        boolean,
        D,
        "the host's paths become case-insensitive regular expressions anchored at the "
        "start (nginx `location ~*`), longest first, as ingress-nginx; a prefix-replacement "
        "rewrite stays a case-sensitive prefix, tried after them",
    ),
    _e(
        "rewrite-target",
        rewrite_target,
        D,
        "without capture groups: the whole path is "
        "replaced (nginx `rewrite ... break`); `P(/|$)(.*)` with `/$2` replaces the prefix; "
        "other capture groups ($1..$9) are expanded from the path regex's match of the path "
        "as sent (nginx matches its decoded $uri)",
    ),
    _e("app-root", path, D, "`/` redirects (302) to it; the request's query is kept"),
    _e("x-forwarded-prefix", header_value, H, "sent as the X-Forwarded-Prefix request header"),
    _e(
        "preserve-trailing-slash",
        boolean,
        H,
        "the HTTPS redirect keeps a trailing slash (`true`) or drops it (`false`, the "
        "default), as ingress-nginx",
    ),
    _e("server-alias", hosts, H, "more host names served by the same routes"),
    _e("upstream-vhost", hosts, H, "the Host the backend sees"),
    # ------------------------------------------------------------ redirects
    _e(
        "permanent-redirect",
        url_or_path,
        H,
        "every request is answered `return CODE URL` as nginx: the Location is the target "
        "exactly as written (its query string included, the request's not appended)",
    ),
    _e(
        "permanent-redirect-code",
        integer,
        H,
        "300-308 as ingress-nginx (else 301); a code that is not a redirect (300, 304-306) "
        "answers the target as a text/html body, as nginx's return",
    ),
    _e(
        "temporal-redirect",
        url_or_path,
        H,
        "every request is answered `return CODE URL` as nginx: the Location is the target "
        "exactly as written (its query string included, the request's not appended)",
    ),
    _e(
        "temporal-redirect-code",
        integer,
        H,
        "300-307 as ingress-nginx (else 302); a code that is not a redirect (300, 304-306) "
        "answers the target as a text/html body, as nginx's return",
    ),
    _e(
        "ssl-redirect",
        boolean,
        H,
        "HTTP requests for TLS hosts are answered 308 to HTTPS (the default, as ingress-nginx)",
    ),
    _e(
        "force-ssl-redirect",
        boolean,
        H,
        "308 to HTTPS also for hosts without TLS",
    ),
    _e("from-to-www-redirect", boolean, H, "the other of www.HOST and HOST answers 308 to it"),
    _e(
        "use-port-in-redirects",
        boolean,
        D,
        "a Location made absolute from proxy-redirect-to keeps the port the client "
        "addressed (its Host) when it is not the scheme's; the proxy's own redirects to a "
        "path name the Ingress's port (80/443), so none",
    ),
    _e(
        "relative-redirects",
        boolean,
        N,
        "nginx's own redirects (absolute_redirect): the "
        "proxy sends no redirects of its own besides these annotations'",
    ),
    _e("proxy-redirect-from", plain, H, _PROXY_REDIRECT),
    _e("proxy-redirect-to", plain, H, _PROXY_REDIRECT),
    # ------------------------------------------------------------ access
    _e("whitelist-source-range", cidrs, H, _RANGES, access=True),
    _e("allowlist-source-range", cidrs, H, _RANGES, access=True),
    _e("denylist-source-range", cidrs, H, _RANGES, access=True),
    _e("auth-type", one_of("basic", "digest"), H, _BASIC, access=True),
    _e("auth-secret", name, H, _BASIC, access=True),
    _e("auth-secret-type", one_of("auth-file", "auth-map"), H, _BASIC, access=True),
    _e("auth-realm", header_value, H, _BASIC, access=True),
    _e("auth-url", url, H, _AUTH, access=True),
    _e("auth-method", methods, H, _AUTH, access=True),
    _e("auth-signin", signin_url, H, _AUTH, access=True),
    _e(
        "auth-signin-redirect-param",
        _matching(re.compile(r"[A-Za-z0-9_-]{1,64}"), "a query parameter name"),
        H,
        _AUTH,
        access=True,
    ),
    _e("auth-response-headers", headers, H, _AUTH, access=True),
    _e("auth-request-redirect", url_or_path, H, _AUTH, access=True),
    _e("auth-proxy-set-headers", name, H, _AUTH, access=True),
    _e("auth-cache-key", cache_key, H, _AUTH_CACHE, access=True),
    _e("auth-cache-duration", cache_duration, H, _AUTH_CACHE, access=True),
    _e("auth-always-set-cookie", boolean, H, _ALWAYS_COOKIE, access=True),
    _e("auth-keepalive", integer, N, _KEEPALIVE, access=True),
    _e("auth-keepalive-share-vars", boolean, N, _KEEPALIVE, access=True),
    _e("auth-keepalive-requests", integer, N, _KEEPALIVE, access=True),
    _e("auth-keepalive-timeout", integer, N, _KEEPALIVE, access=True),
    _e(
        "enable-global-auth",
        boolean,
        H,
        '"false": the ConfigMap\'s global-auth-url does not apply to this Ingress',
        access=True,
    ),
    _e(
        "auth-snippet", any_text, X, "a snippet of the external authentication request", access=True
    ),
    _e(
        "auth-tls-secret",
        name,
        H,
        "the Secret's ca.crt (and ca.crl) verify client certificates on the host's TLS "
        "server name; the Ingress's namespace only, as ingress-nginx's default",
        access=True,
    ),
    _e(
        "auth-tls-verify-client",
        one_of("on", "off", "optional", "optional_no_ca"),
        H,
        "nginx's ssl_verify_client: a missing or failed certificate is a 400 (on), a "
        "failed one (optional), an untrusted issuer passes as FAILED (optional_no_ca)",
        access=True,
    ),
    _e(
        "auth-tls-verify-depth",
        integer,
        H,
        "OpenSSL's verify depth (intermediate CAs between the certificate and ca.crt)",
        access=True,
    ),
    _e(
        "auth-tls-error-page",
        url_or_path,
        H,
        "a missing or failed certificate is redirected there (302), as error_page 495 496",
        access=True,
    ),
    _e(
        "auth-tls-pass-certificate-to-upstream",
        boolean,
        H,
        "ssl-client-cert (URL-encoded PEM) to the backend; ssl-client-verify, "
        "-subject-dn and -issuer-dn always (a client's own are dropped)",
        access=True,
    ),
    _e(
        "auth-tls-match-cn",
        _matching(
            re.compile(r"CN=[A-Za-z0-9 ._*|()^+?-]{1,256}"), "CN= and a plain regular expression"
        ),
        H,
        "an RE2 search of the subject DN (RFC 2253, as $ssl_client_s_dn); no match: 403",
        access=True,
    ),
    _e(
        "satisfy",
        one_of("all", "any"),
        H,
        "any: the source range or the credentials suffice (401 when both fail)",
        access=True,
    ),
    # ------------------------------------------------------------ traffic
    _e("canary", boolean, H, _CANARY),
    _e("canary-weight", integer, H, _CANARY),
    _e("canary-weight-total", integer, H, _CANARY),
    _e("canary-by-header", _matching(_HEADER, "a header name"), H, _CANARY),
    _e("canary-by-header-value", header_value, H, _CANARY),
    _e("canary-by-header-pattern", regex, D, _CANARY + "; the pattern in RE2 syntax"),
    _e("canary-by-cookie", _matching(_HEADER, "a cookie name"), H, _CANARY),
    _e(
        "affinity",
        one_of("cookie"),
        D,
        "sticky cookie: a keyed hash naming the endpoint; Path=/, HttpOnly, no expiry",
    ),
    _e(
        "affinity-mode",
        one_of("balanced", "persistent"),
        D,
        "the cookie's endpoint wins "
        "while it is live (persistent); balanced rebalancing on scale-up is not done",
    ),
    _e(
        "affinity-canary-behavior",
        one_of("sticky", "legacy"),
        D,
        "on the canary Ingress: sticky (the default) keeps a client on the side its "
        "cookie names, legacy sets no cookie from the canary; a cookie naming an endpoint "
        "no longer ready is decided afresh (ingress-nginx's names the backend)",
    ),
    _e("session-cookie-name", _matching(_HEADER, "a cookie name"), H),
    _e("session-cookie-samesite", one_of("None", "Lax", "Strict"), H),
    _e("session-cookie-path", path, H, "the sticky cookie's Path"),
    _e("session-cookie-domain", hosts, H, "the sticky cookie's Domain"),
    _e("session-cookie-expires", seconds, D, "sent as Max-Age (the same lifetime), not a date"),
    _e("session-cookie-max-age", seconds, H, "the sticky cookie's Max-Age"),
    _e("session-cookie-secure", boolean, H, "the sticky cookie's Secure"),
    _e(
        "session-cookie-conditional-samesite-none",
        boolean,
        D,
        "SameSite=None is sent to every client (ingress-nginx leaves it out for user "
        "agents known to reject it)",
    ),
    _e(
        "session-cookie-change-on-failure",
        boolean,
        D,
        "a cookie naming a failed endpoint "
        "is answered by another endpoint and replaced (as `true`)",
    ),
    _e(
        "load-balance",
        one_of("round_robin", "ewma"),
        H,
        "round_robin (ingress-nginx's default); ewma becomes leastconn",
    ),
    _e(
        "upstream-hash-by",
        _matching(re.compile(r"\$[a-z_]{1,64}"), "an nginx variable such as $remote_addr"),
        H,
        "$remote_addr and $binary_remote_addr hash the client address, $request_uri, "
        "$host, $http_*, $cookie_* and $arg_* their value (the proxy's source balancing), "
        "exactly with upstream-hash-by-subset; alone, with bounded loads (a named "
        "difference); other variables are not honoured",
    ),
    _e(
        "upstream-hash-by-subset",
        boolean,
        H,
        "the key hashes to one subset of endpoints and the request goes to one of them "
        "at random (ingress-nginx's chashsubset; subsets cut from the endpoints in the "
        "order of their names); a subset whose endpoints all fail to connect gives its "
        "keys to the next subset",
    ),
    _e(
        "upstream-hash-by-subset-size",
        _matching(re.compile(r"\d{1,9}"), "a number of endpoints (0: 3)"),
        H,
        "endpoints per subset (0 or unset: 3, ingress-nginx's default)",
    ),
    _e("limit-rps", integer, H, _LIMITED, access=True),
    _e("limit-rpm", integer, H, _LIMITED, access=True),
    _e("limit-connections", integer, H, _LIMITED, access=True),
    _e("limit-burst-multiplier", integer, H, _LIMITED, access=True),
    _e("limit-whitelist", cidrs, H, _LIMITED, access=True),
    _e("limit-allowlist", cidrs, H, _LIMITED, access=True),
    _e("limit-rate", integer, D, _LIMIT_RATE, access=True),
    _e("limit-rate-after", integer, D, _LIMIT_RATE, access=True),
    _e("global-rate-limit", integer, X, _LIMIT, access=True, lacks=True),
    _e("global-rate-limit-window", plain, X, _LIMIT, access=True, lacks=True),
    _e("global-rate-limit-key", plain, X, _LIMIT, access=True, lacks=True),
    _e("global-rate-limit-ignored-cidrs", cidrs, X, _LIMIT, access=True, lacks=True),
    # ------------------------------------------------------------ upstream
    _e(
        "backend-protocol",
        one_of("HTTP", "HTTPS", "GRPC", "GRPCS", "AUTO_HTTP", "AJP", "FCGI", case=False),
        D,
        "HTTP, GRPC (h2c) exactly; HTTPS, GRPCS and AUTO_HTTP (per request: HTTPS when "
        "the client came over HTTPS, plain HTTP otherwise) verify the backend's "
        "certificate against proxy-ssl-secret's ca.crt, else the system CAs (nginx "
        "verifies only with proxy-ssl-verify on); AJP and FCGI are not honoured",
    ),
    _e(
        "service-upstream",
        boolean,
        H,
        "the backend's one endpoint is its Service's cluster IP at the Service port "
        "(kube-proxy or the mesh balances; the ConfigMap's service-upstream is the "
        "default); a Service without a cluster IP (headless, ExternalName) keeps its "
        "endpoints, as ingress-nginx falls back to them; decided per Ingress (ingress-nginx "
        "lets the first Ingress naming a Service port decide for all)",
    ),
    _e("proxy-connect-timeout", seconds, H, "the connect timeout to the backend"),
    _e(
        "proxy-read-timeout",
        seconds,
        D,
        "one inactivity timeout for the backend both ways (WebSocket connections too): "
        "the larger of read and send",
    ),
    _e(
        "proxy-send-timeout",
        seconds,
        D,
        "one inactivity timeout for the backend both ways (WebSocket connections too): "
        "the larger of read and send",
    ),
    _e(
        "proxy-next-upstream",
        plain,
        D,
        "`error` and `timeout`: another endpoint after a connect that failed or timed out, "
        "nothing sent yet; a failure after the request was sent is answered 502 (nginx also "
        "retries a failed send or response head), except that an idempotent request without "
        "a body whose reused connection closed before answering is sent once more, `off` "
        "too; http_*, invalid_header and non_idempotent: the answer is dropped and the "
        "request sent to another endpoint only when it can be resent exactly (no body, or "
        "one buffered whole in memory)",
    ),
    _e("proxy-next-upstream-tries", integer, H, "connects tried at most (1 to 100)"),
    _e(
        "proxy-next-upstream-timeout",
        seconds,
        D,
        "bounds the answers' redispatches from the request's start; connects are bounded "
        "by -tries and the connect timeout",
    ),
    _e(
        "proxy-body-size",
        size,
        H,
        "a larger request body is answered 413 (Content-Length up front; a body "
        "without one counted as it streams); `0`: no limit",
    ),
    _e(
        "proxy-request-buffering",
        one_of("on", "off"),
        H,
        "the route's requestBuffering: `on` (the default) takes the body in (memory, then "
        "a temporary file, up to --request-buffer-max) before a backend connection is used; "
        "`off` streams it; gRPC requests are never buffered",
    ),
    _e("proxy-buffering", one_of("on", "off"), N, _BUFFER),
    _e("proxy-buffers-number", integer, N, _BUFFER),
    _e("proxy-buffer-size", size, N, _BUFFER),
    _e("proxy-busy-buffers-size", size, N, _BUFFER),
    _e("proxy-max-temp-file-size", size, N, _BUFFER),
    _e("client-body-buffer-size", size, N, _BUFFER),
    _e(
        "proxy-http-version",
        one_of("1.0", "1.1"),
        H,
        "1.1 (or HTTP/2 where the backend speaks it); 1.0 as nginx: HTTP/1.0 requests with "
        "Connection: close, one per connection, a body of unknown length buffered and sent "
        "with Content-Length; an upgrade is refused (502: HTTP/1.0 has none); a backend "
        "that speaks HTTP/2 (GRPC, GRPCS, an h2c Service) is unaffected",
    ),
    _e("proxy-cookie-domain", plain, H, _PROXY_COOKIE),
    _e("proxy-cookie-path", plain, H, _PROXY_COOKIE),
    _e(
        "proxy-ssl-secret",
        name,
        H,
        "tls.crt and tls.key: the client certificate presented to the HTTPS backend; "
        "ca.crt: the CAs its certificate is verified against; a Secret that cannot be "
        "used makes the Ingress not served (ingress-nginx denies the location: 503)",
    ),
    _e(
        "proxy-ssl-verify",
        one_of("on", "off"),
        D,
        "the backend's certificate is always "
        "verified (`off` is not honoured: verification stays on)",
    ),
    _e("proxy-ssl-verify-depth", integer, N, "chain depth: the proxy verifies the whole chain"),
    _e("proxy-ssl-name", hosts, H, "the name verified and sent as SNI"),
    _e("proxy-ssl-server-name", one_of("on", "off"), D, "SNI is always sent (`off` too)"),
    _e(
        "proxy-ssl-ciphers",
        _matching(re.compile(r"[A-Za-z0-9:_+!-]{1,2048}"), "an OpenSSL cipher list"),
        N,
        "the proxy's TLS 1.2+ cipher policy applies",
    ),
    _e(
        "proxy-ssl-protocols",
        _matching(
            re.compile(
                r"(TLSv1(\.[123])?|SSLv[23])( TLSv1(\.[123"
                r"])?| SSLv[23])*"
            ),
            "TLS protocol names",
        ),
        N,
        "the proxy speaks TLS 1.2+ only",
    ),
    _e(
        "ssl-passthrough",
        boolean,
        H,
        "the host's TLS relayed by SNI on the HTTPS port to "
        "the backend of its `/` path (as --enable-ssl-passthrough)",
    ),
    _e("mirror-target", mirror_url, D, _MIRROR),
    _e("mirror-host", hosts, H, "the Host of the copy (default: the URL's host)"),
    _e("mirror-request-body", one_of("on", "off"), D, _MIRROR),
    _e(
        "connection-proxy-header",
        one_of("keep-alive", "close", "upgrade", case=False),
        H,
        "the Connection value an HTTP/1.1 backend gets (an upgrade the client asked for "
        "keeps `upgrade`; an HTTP/2 backend gets no Connection header)",
    ),
    _e("fastcgi-index", plain, X, "FastCGI backends"),
    _e("fastcgi-params-configmap", name, X, "FastCGI backends"),
    # ------------------------------------------------------------ responses
    _e("enable-cors", boolean, H, _CORS),
    _e(
        "cors-allow-origin",
        origins,
        D,
        "the whole Origin must match a listed one, case-insensitively "
        "(ingress-nginx anchors its regex only at the end)",
    ),
    _e("cors-allow-methods", methods, H, _CORS),
    _e("cors-allow-headers", headers, H, _CORS),
    _e("cors-expose-headers", headers, H, _CORS),
    _e("cors-allow-credentials", boolean, H, _CORS),
    _e("cors-max-age", integer, H, _CORS),
    _e(
        "custom-headers",
        name,
        H,
        "the ConfigMap's entries set on every response; a missing ConfigMap, a bad header "
        "or one the controller ConfigMap's global-allowed-response-headers does not list: "
        "not served (ingress-nginx answers 503)",
    ),
    _e(
        "custom-http-errors",
        status_codes,
        D,
        "the backend's answers with these statuses, and the proxy's own failures with them "
        "(a refused or broken backend's 502), are replaced by the default-backend "
        "Service's (else the proxy's own error page) to GET / with X-Code, X-Format, "
        "X-Original-URI, X-Namespace, X-Ingress-Name, X-Service-Name, X-Service-Port and "
        "X-Request-ID, its status the client's; the error backend gets no request body, an "
        "answer that comes while the request body still streams is not intercepted, and "
        "the proxy's timeouts (504) and refusals before a backend is asked keep its own pages",
    ),
    _e(
        "default-backend",
        name,
        H,
        "the Service (its first port) takes the requests, as they are, with X-Code 503 and "
        "the route's names, when the Ingress's Service has no ready endpoint, and is "
        "custom-http-errors' error backend",
    ),
    _e(
        "disable-proxy-intercept-errors",
        boolean,
        H,
        "the backend's answers pass unchanged (the proxy's own failures with a listed "
        "status still go to the error backend, as nginx's error_page)",
    ),
    _e(
        "enable-access-log",
        boolean,
        H,
        "`false`: the proxy writes no access-log line for the route's requests (its metrics "
        "and spans stay)",
    ),
    _e("enable-rewrite-log", boolean, N, "nginx's debug log of rewrites"),
    _e(
        "enable-opentelemetry",
        boolean,
        H,
        "off (ingress-nginx's default, the ConfigMap's key else): no span, a client's "
        "traceparent passed on as it came; on: spans at the proxy's own sampling (its "
        "--trace-ratio, a client's sampled trace continued), not the ConfigMap's "
        "otel-sampler* keys",
    ),
    _e(
        "opentelemetry-trust-incoming-span",
        boolean,
        H,
        "`false`: a client's trace context is neither continued nor passed on (the "
        "request is sampled as one without it)",
    ),
    _e(
        "opentelemetry-operation-name",
        span_template,
        H,
        "the SERVER span's name; $request_method, $uri, $request_uri, $host, $scheme "
        "filled in per request, $service_name, $namespace, $ingress_name, "
        "$location_path per route; other variables are not honoured",
    ),
    _e("enable-opentracing", boolean, N, "removed from ingress-nginx (OpenTelemetry instead)"),
    _e("opentracing-trust-incoming-span", boolean, N, "removed from ingress-nginx"),
    _e("http2-push-preload", boolean, N, "HTTP/2 server push is gone from browsers"),
    _e(
        "ssl-ciphers",
        _matching(re.compile(r"[A-Za-z0-9:_+!-]{1,2048}"), "an OpenSSL cipher list"),
        D,
        "the host's TLS 1.2 suites (nginx's server-level ssl_ciphers; TLS 1.3's are "
        "OpenSSL's), over the ConfigMap's; host-wide, and with several Ingresses of the "
        "host giving lists, one of them serves it",
    ),
    _e("ssl-prefer-server-ciphers", boolean, N, "the proxy's TLS stack orders its ciphers"),
    # ------------------------------------------------------------ snippets and WAF
    _e(
        "configuration-snippet",
        any_text,
        X,
        "nginx configuration text (a literal subset is "
        "honoured when the ConfigMap allows snippets)",
    ),
    _e(
        "server-snippet",
        any_text,
        X,
        "nginx configuration text (a literal subset is "
        "honoured when the ConfigMap allows snippets)",
    ),
    _e("stream-snippet", any_text, X, "nginx stream configuration text"),
    _e("enable-modsecurity", boolean, X, _WAF, access=True),
    _e("enable-owasp-core-rules", boolean, X, _WAF, access=True),
    _e("modsecurity-transaction-id", plain, X, _WAF, access=True),
    _e("modsecurity-snippet", any_text, X, _WAF, access=True),
    _e("enable-influxdb", boolean, N, "removed from ingress-nginx"),
    _e("influxdb-measurement", plain, N, "removed from ingress-nginx"),
    _e("influxdb-port", plain, N, "removed from ingress-nginx"),
    _e("influxdb-host", plain, N, "removed from ingress-nginx"),
    _e("influxdb-server-name", plain, N, "removed from ingress-nginx"),
)

CATALOGUE: dict[str, Entry] = {entry.name: entry for entry in ENTRIES}

#: Snippet annotations (their text is parsed by `annotations`, never rendered).
SNIPPETS = frozenset(("configuration-snippet", "server-snippet", "auth-snippet", "stream-snippet"))


def is_access(short: str) -> bool:
    """Bears on who reaches the backend (the issue's list), catalogued or not."""
    entry = CATALOGUE.get(short)
    if entry is not None and entry.access:
        return True
    return short.startswith(("auth-", "limit-", "modsecurity-")) or short.endswith("-source-range")


def proxy_lacks() -> list[str]:
    """The annotations not honoured (or honoured only in part) only for want of a
    per-request behaviour in the proxy."""
    return sorted(entry.name for entry in ENTRIES if entry.proxy_lacks)
