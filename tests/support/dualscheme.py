"""A backend that answers TLS and plain HTTP/1.1 on one port, saying which arrived.

ingress-nginx's backend-protocol AUTO_HTTP (`proxy_pass $scheme://`) reaches the same
Service port over TLS or not as the client came: `DualBackend` peeks at each
connection's first byte (MSG_PEEK, so it stays for the handshake), serves a TLS
handshake's (0x16) over TLS and anything else in plain HTTP, and answers every
request 200 with JSON naming the scheme and the client certificate's CN. Blocking
sockets on threads, every socket with a timeout; `with` starts and stops it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading


class DualBackend:
    """One port, both schemes: a connection whose first byte is a TLS handshake's
    (0x16) is served over TLS, any other in plain HTTP. Every answer is 200 with a
    JSON body naming the scheme that arrived and the client certificate's CN.
    Blocking sockets on a thread (MSG_PEEK leaves the first byte to TLS)."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        self.context = context
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.connections: list[str] = []  # the scheme of each connection, in order
        self.heads: list[bytes] = []  # each request's head as it arrived, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._serving: list[threading.Thread] = []
        self._open: set[socket.socket] = set()

    def __enter__(self) -> DualBackend:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.listener.close()
        for conn in list(self._open):  # (a peer that keeps its connection open)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv
        for thread in self._serving:
            thread.join(10)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self._open.add(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._serving.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            first = conn.recv(1, socket.MSG_PEEK)
            scheme, peer_cn = "http", ""
            if first == b"\x16":
                if self.context is None:
                    return
                scheme = "https"
                self._open.discard(conn)
                conn = self.context.wrap_socket(conn, server_side=True)
                self._open.add(conn)
                peer = conn.getpeercert()
                for rdn in (peer or {}).get("subject", ()):
                    for key, value in rdn:
                        if key == "commonName":
                            peer_cn = value
            buffered = b""
            counted = False
            while True:
                while b"\r\n\r\n" not in buffered:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buffered += chunk
                head, buffered = buffered.split(b"\r\n\r\n", 1)
                self.heads.append(head)
                if not counted:  # (a connection that sends no request is not one)
                    self.connections.append(scheme)
                    counted = True
                body = json.dumps({"scheme": scheme, "client": peer_cn}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
        except (OSError, ssl.SSLError):
            return
        finally:
            self._open.discard(conn)
            conn.close()
