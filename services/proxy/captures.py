"""ingress-nginx's rewrite-target with capture groups, sans-IO.

ingress-nginx renders `rewrite "(?i)PATH" TARGET break;` in the path's regex
location: the path the backend gets is TARGET with `$1`..`$9` replaced by the
groups of the route's path regex matched against the request's path (a group
that did not take part: empty), and the request's query string appended, as
nginx's rewrite does when TARGET has none. The route's match is the compiled
path regex routing already holds (`RouteEntry.regex`): the rewrite uses the
same engine and the same match, nothing is compiled per request.

Difference (named in the catalogue): nginx matches its normalised `$uri`
(percent-decoded, slashes merged); the proxy matches the path as the client
sent it (routing's), so percent-encoded bytes stay encoded in the new path.
"""

from __future__ import annotations

import re
from typing import Any

from waygate.core.regex import LinearPattern

_GROUP = re.compile(r"\$([1-9])")


def expand(template: str, match: re.Match[str]) -> str:
    """TARGET with $N replaced by the match's group N ("" when it took no part or
    the regex has fewer groups)."""

    def group(found: re.Match[str]) -> str:
        index = int(found.group(1))
        if index > (match.re.groups or 0):
            return ""
        return match.group(index) or ""

    return _GROUP.sub(group, template)


def rewritten(req: Any, regex: LinearPattern, template: str, path: bytes) -> Any:
    """The request as the backend gets it (None: the regex does not match its path)."""
    match = regex.fullmatch(path.decode("utf-8", "replace"))
    if match is None:
        return None
    new = expand(template, match) or "/"
    if not new.startswith("/"):
        new = "/" + new
    target = req.target
    query = target.find(b"?")
    out = req.copy()
    out.target = new.encode("utf-8") + (target[query:] if query >= 0 else b"")
    return out
