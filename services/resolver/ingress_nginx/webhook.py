"""A ValidatingAdmissionWebhook for Ingress: the same verdicts, before the object is stored.

`kubectl apply` of an Ingress of the ingress-nginx class that Waygate would not
serve fails with the reason (the refusal `annotations.plan` gives); one served
with annotations not honoured exactly is admitted with a warning per annotation
(AdmissionReview v1 `warnings`, shown by kubectl). Other kinds, other classes
and DELETE are admitted untouched.

Unlike ingress-nginx's webhook (CVE-2025-1974: it rendered and tested an nginx
configuration from the object under review, so a crafted AdmissionReview ran
code), this one renders nothing: it parses, checks grammars and answers.

The listener (off by default; --admission-webhook-port) speaks HTTPS only, with
the process's certificate (from certs, or its static TLS files): POST /validate,
one request per connection, the head within `head_timeout` and at most 16 KiB,
the body at most 3 MiB (the API server's own object limit) within
`body_timeout`, at most `max_connections` at once (more are answered 503).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from waygate.resolver.ingress_nginx import annotations as planner
from waygate.resolver.ingress_nginx.config import (
    IngressNginx,
    class_of,
    classes,
    default_class,
)

log = logging.getLogger(__name__)

JSON = dict[str, Any]
PATH = "/validate"
MAX_HEAD = 16 * 1024
MAX_BODY = 3 * 1024 * 1024
MAX_WARNING = 256
# The objects a review reads: IngressClasses, ConfigMaps and Secrets, by (namespace, name).
Lookup = Callable[[str], Mapping[tuple[str, str], JSON]]


class ReviewError(ValueError):
    """The request is not an AdmissionReview this webhook can answer (HTTP 400)."""


def review(body: bytes, settings: IngressNginx, objects: Lookup) -> JSON:
    """An AdmissionReview request (JSON bytes) -> the AdmissionReview response."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ReviewError("the body is not JSON") from None
    if not isinstance(document, dict) or document.get("kind") != "AdmissionReview":
        raise ReviewError("not an AdmissionReview")
    if document.get("apiVersion") != "admission.k8s.io/v1":
        raise ReviewError("only admission.k8s.io/v1 AdmissionReview is answered")
    request = document.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise ReviewError("request.uid is required")
    response: JSON = {"uid": request["uid"], "allowed": True}
    out = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
    kind = request.get("kind") or {}
    obj = request.get("object")
    if (
        not isinstance(kind, dict)
        or kind.get("kind") != "Ingress"
        or request.get("operation") not in ("CREATE", "UPDATE")
        or not isinstance(obj, dict)
    ):
        return out
    metadata = obj.setdefault("metadata", {})
    if not isinstance(metadata, dict) or not isinstance(metadata.get("annotations") or {}, dict):
        raise ReviewError("request.object.metadata (and its annotations) must be objects")
    if not metadata.get("namespace"):
        metadata["namespace"] = str(request.get("namespace") or "default")
    ours = classes(objects("IngressClass"), settings)
    if (class_of(obj) or default_class(ours)) not in ours:
        return out
    plan, _ = planner.judge(obj, settings, objects("ConfigMap"), objects("Secret"))
    warnings = [
        line if len(line) <= MAX_WARNING else line[: MAX_WARNING - 3] + "..."
        for line in plan.verdict_lines()
    ]
    if warnings:
        response["warnings"] = warnings
    if plan.refusal_reason:
        response["allowed"] = False
        response["status"] = {
            "code": 403,
            "reason": "Forbidden",
            "message": f"Waygate would not serve this Ingress ({plan.refusal_reason}): "
            f"{plan.refusal}",
        }
    return out


def _answer(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class WebhookServer:
    """The HTTPS listener answering AdmissionReviews (see the module docstring)."""

    def __init__(
        self,
        settings: IngressNginx,
        objects: Lookup,
        context: ssl.SSLContext,
        *,
        head_timeout: float = 5.0,
        body_timeout: float = 10.0,
        max_connections: int = 64,
    ) -> None:
        self.settings = settings
        self.objects = objects
        self.context = context
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        self._open = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(
            self._handle,
            host,
            port,
            ssl=self.context,
            limit=MAX_HEAD,
            ssl_handshake_timeout=self.head_timeout,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > self.max_connections:
                writer.write(_answer("503 Service Unavailable", b"too many connections\n"))
            else:
                writer.write(await self._exchange(reader))
            await asyncio.wait_for(writer.drain(), self.head_timeout)
        except (ConnectionError, TimeoutError, ssl.SSLError):
            pass
        finally:
            self._open -= 1
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (ConnectionError, TimeoutError, ssl.SSLError):
                writer.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader) -> bytes:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.head_timeout)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return _answer("400 Bad Request", b"incomplete, oversized or slow request head\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _answer("400 Bad Request", b"malformed request line\n")
        method, target = parts[0], parts[1].split("?", 1)[0]
        if target != PATH:
            return _answer("404 Not Found", f"not found; the webhook is POST {PATH}\n".encode())
        if method != "POST":
            return _answer("405 Method Not Allowed", b"only POST\n")
        fields = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                fields[name.strip().lower()] = value.strip()
        if "transfer-encoding" in fields:
            return _answer("411 Length Required", b"send Content-Length, not chunks\n")
        length_text = fields.get("content-length", "")
        if not length_text.isdigit():
            return _answer("411 Length Required", b"Content-Length is required\n")
        length = int(length_text)
        if length > MAX_BODY:
            return _answer("413 Content Too Large", b"the review is larger than 3 MiB\n")
        try:
            body = await asyncio.wait_for(reader.readexactly(length), self.body_timeout)
        except (TimeoutError, asyncio.IncompleteReadError):
            return _answer("400 Bad Request", b"incomplete or slow request body\n")
        try:
            answer = review(body, self.settings, self.objects)
        except ReviewError as exc:
            return _answer("400 Bad Request", f"{exc}\n".encode())
        except Exception:  # a bug of ours: the API server gets a reason, the log the trace
            log.exception("admission review failed")
            return _answer("500 Internal Server Error", b"the review failed; see the log\n")
        allowed = answer["response"]["allowed"]
        log.info(
            "admission review",
            extra={"uid": answer["response"]["uid"], "allowed": allowed},
        )
        return _answer("200 OK", json.dumps(answer).encode(), "application/json")


async def start_webhook(process: Any, settings: Any, objects: Lookup) -> WebhookServer:
    """The resolver's webhook listener (--admission-webhook-port) with the process's own
    certificate (from certs, or its static TLS files); SettingsError without one."""
    from waygate.core.settings import SettingsError

    context = await process.server_ssl_context()
    nginx = IngressNginx.from_settings(settings)
    if context is None or nginx is None:
        raise SettingsError(
            "invalid setting admission_webhook_port: the webhook needs a certificate "
            "(--certs-address, or --tls-cert-file and --tls-key-file)"
        )
    webhook = WebhookServer(nginx, objects, context)
    port = await webhook.start(settings.host, settings.admission_webhook_port)
    process.on_stop(webhook.stop)
    log.info("admission webhook listening", extra={"webhook_port": port})
    return webhook
