"""An external authentication service (what ingress-nginx's auth-url names), for tests.

A real HTTP/1.1 server on 127.0.0.1 that records every subrequest's head and
answers by the Authorization header: `Bearer good` 200 (with X-User: alice and
X-Auth-Extra), and Basic user:password 200 (httpbin's /basic-auth/user/password,
what ingress-nginx's e2e auth tests ask), `Bearer forbidden` 403, `Bearer broken` 502, anything else 401.
A subrequest to /slow is answered after `slow_seconds`. A subrequest to
/cookies/set/KEY/VALUE is answered 200 with `Set-Cookie: KEY=VALUE` whatever its
Authorization (ingress-nginx's e2e auth service for the cookie cases), one to
/cookies/deny/KEY/VALUE 401 with that Set-Cookie. With `tls` (a server
SSLContext) it serves HTTPS (`url` then says https). `open` counts the
connections it holds now (a cancelled subrequest must close its connection).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl

BASIC_USER_PASSWORD = "Basic " + base64.b64encode(b"user:password").decode()


class AuthService:
    def __init__(self, slow_seconds: float = 10.0, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.requests: list[dict[str, object]] = []
        self.slow_seconds = slow_seconds
        self.open = 0
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> AuthService:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def url(self, path: str = "/auth") -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}{path}"

    def header(self, index: int, name: str) -> str | None:
        headers = self.requests[index]["headers"]
        for key, value in headers:  # type: ignore[attr-defined]
            if key.lower() == name.lower():
                return str(value)
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = [tuple(line.split(": ", 1)) for line in lines[1:] if line]
            self.requests.append({"method": method, "target": target, "headers": headers})
            if target.startswith("/slow"):
                # Until the proxy lets go of the subrequest (EOF), or the delay passed.
                with contextlib.suppress(TimeoutError):
                    if not await asyncio.wait_for(reader.read(), self.slow_seconds):
                        return
            authorization = dict((k.lower(), v) for k, v in headers).get("authorization", "")
            if target.startswith(("/cookies/set/", "/cookies/deny/")):
                _, _, verb, key, value = target.split("?")[0].split("/", 4)
                status = b"200 OK" if verb == "set" else b"401 Unauthorized"
                answer = b"HTTP/1.1 %s\r\nSet-Cookie: %s=%s\r\nContent-Length: 3\r\n\r\nOK\n" % (
                    status,
                    key.encode(),
                    value.encode(),
                )
            elif authorization in ("Bearer good", BASIC_USER_PASSWORD):
                answer = (
                    b"HTTP/1.1 200 OK\r\nX-User: alice\r\nX-Auth-Extra: yes\r\n"
                    b"Content-Length: 2\r\n\r\nok"
                )
            elif authorization == "Bearer forbidden":
                answer = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"
            elif authorization == "Bearer broken":
                answer = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n"
            else:
                answer = (
                    b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\n"
                    b"Content-Length: 0\r\n\r\n"
                )
            writer.write(answer)
            await writer.drain()
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            TimeoutError,
            asyncio.LimitOverrunError,
            ssl.SSLError,
        ):
            pass
        finally:
            self.open -= 1
            writer.close()
