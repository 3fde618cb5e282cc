"""ingress-nginx's upstream-hash-by: the request's nginx variable as the hash key, sans-IO.

The route balances by consistent hashing (`balancing.SourceHashPicker`, the
proxy's `source` policy) of the value of one nginx variable the proxy can
compute exactly from the request: `$request_uri` (the target as sent), `$host`
(lower-cased, no port), `$http_NAME` (the first NAME header, `_` for `-`, as
sent), `$cookie_NAME` and `$arg_NAME` (the first such query argument, its name
matched case-insensitively, its value as sent). An absent value is the empty
key, as nginx's empty variable (every such request to one endpoint).

The variable is read once per route entry (`HashKey`, its header pattern
compiled then); per request only the value is looked up.
"""

from __future__ import annotations

import re

from waygate.proxy.http1 import RequestHead

# The resolver passes only these (ingress_nginx.annotations' _HASH_VARIABLE).
PREFIXES = ("$http_", "$cookie_", "$arg_")


class HashKey:
    """One route's hash key: `of(req)` is the variable's value for a request."""

    __slots__ = ("header", "kind", "name")

    def __init__(self, variable: str) -> None:
        self.kind = variable
        self.name = b""
        self.header: re.Pattern[bytes] | None = None
        for prefix in PREFIXES:
            if variable.startswith(prefix):
                self.kind = prefix
                self.name = variable[len(prefix) :].encode()
        if self.kind == "$http_":
            name = re.escape(self.name.replace(b"_", b"-"))
            self.header = re.compile(
                rb"(?:^|\n)" + name + rb":[ \t]*([^\r\n]*?)[ \t]*\r", re.IGNORECASE
            )

    def of(self, req: RequestHead) -> bytes:
        kind = self.kind
        if kind == "$request_uri":
            return req.target
        if kind == "$host":
            return req.host
        if kind == "$http_":
            assert self.header is not None
            found = self.header.search(req.fields)
            return found.group(1) if found else b""
        if kind == "$cookie_":
            prefix = self.name + b"="
            for value in req.cookie:
                for part in value.split(b";"):
                    part = part.strip()
                    if part.startswith(prefix):
                        return part[len(prefix) :]
            return b""
        target = req.target  # $arg_
        mark = target.find(b"?")
        if mark < 0:
            return b""
        wanted = self.name.lower()
        for pair in target[mark + 1 :].split(b"&"):
            name, _, value = pair.partition(b"=")
            if name.lower() == wanted:
                return value
        return b""
