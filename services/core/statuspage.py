"""The admin port's status page: `/` (HTML) and `/status.json` (the same data).

Core knows no service: a service contributes sections through `StatusPage.add`,
each a callable returning `Section`s (a title, columns, rows of cells). The page
(`static/status.html`, no build step, nothing from a CDN) renders any section the
same way and polls `status.json` to stay live; `waygate up` serves one page that
gathers every child's document (`waygate.supervisor`'s status server).

Invariants: a provider runs on the event loop at request time and only reads
state the service already holds (no I/O); a provider that raises costs its own
sections only (shown as an error), never the page; every section is cut to
`MAX_ROWS` rows, so a document stays bounded however many routes there are.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: Rows one section may show; the rest are counted in its note.
MAX_ROWS = 500

Cell = str | int | float | dict[str, Any] | None


def cell(
    text: Any, state: str = "", *, bar: float | None = None, title: str = ""
) -> dict[str, Any]:
    """A cell with a state (ok, warn, bad), an optional bar (0..1) and a tooltip."""
    value: dict[str, Any] = {"text": text}
    if state:
        value["state"] = state
    if bar is not None:
        value["bar"] = round(min(max(bar, 0.0), 1.0), 4)
    if title:
        value["title"] = title
    return value


def duration_text(seconds: float) -> str:
    """'3d 4h', '5h 12m', '42s': two units at most, as people read time left."""
    if seconds < 0:
        return "expired " + duration_text(-seconds) + " ago"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def expiry_cell(
    not_after: datetime, not_before: datetime | None = None, *, now: datetime | None = None
) -> dict[str, Any]:
    """Time left as a bar: the share of the lifetime left (of 30 days when the start is
    unknown); warn under 30%, bad under 10% (renewal runs at 70% of the lifetime)."""
    now = now or datetime.now(UTC)
    left = (not_after - now).total_seconds()
    lifetime = (not_after - not_before).total_seconds() if not_before is not None else 30 * 86400
    share = left / lifetime if lifetime > 0 else 0.0
    state = "bad" if share < 0.1 else "warn" if share < 0.3 else "ok"
    return cell(duration_text(left), state, bar=share, title="not after " + not_after.isoformat())


@dataclass
class Section:
    title: str
    columns: Sequence[str]
    rows: list[list[Any]] = field(default_factory=list)  # cells: see `Cell`
    note: str = ""
    state: str = ""  # ok | warn | bad: the section's title is coloured by it
    empty: str = "none"  # what an empty table says

    def to_json(self) -> dict[str, Any]:
        rows = self.rows[:MAX_ROWS]
        note = self.note
        if len(self.rows) > MAX_ROWS:
            more = f"{len(self.rows) - MAX_ROWS} more not shown (see /metrics or the CLI)"
            note = f"{note}; {more}" if note else more
        return {
            "title": self.title,
            "columns": list(self.columns),
            "rows": rows,
            "note": note,
            "state": self.state,
            "empty": self.empty,
        }


Provider = Callable[[], Iterable[Section]]


class StatusSource(Protocol):
    """What the admin server serves at /status.json."""

    async def document(self) -> dict[str, Any]: ...


class StatusPage:
    """One process's status document: its name, readiness and the services' sections."""

    def __init__(self, service: str, ready: Callable[[], tuple[bool, str]] | None = None) -> None:
        self.service = service
        self.address = ""
        self._ready = ready
        self._providers: list[tuple[str, Provider]] = []

    def add(self, name: str, provider: Provider) -> None:
        """Sections from `provider`, after those added before (`name` is for errors)."""
        self._providers.append((name, provider))

    def sections(self) -> list[dict[str, Any]]:
        found = []
        for name, provider in self._providers:
            try:
                found += [section.to_json() for section in provider()]
            except Exception as exc:  # one broken provider must not take the page down
                log.exception("status provider failed", extra={"provider": name})
                found.append(
                    Section(
                        name, ["error"], [[cell(f"{type(exc).__name__}: {exc}", "bad")]]
                    ).to_json()
                )
        return found

    def service_document(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"service": self.service, "sections": self.sections()}
        if self.address:
            entry["address"] = self.address
        if self._ready is not None:
            entry["ready"], entry["reason"] = self._ready()
        return entry

    async def document(self) -> dict[str, Any]:
        return {
            "title": f"Waygate {self.service}",
            "generated": time.time(),
            "services": [self.service_document()],
        }


def page_html() -> bytes:
    """The page itself (one file: markup, style and script)."""
    return resources.files("waygate.core").joinpath("static/status.html").read_bytes()


#: Largest status document read from one process (a bounded buffer; rows are
#: capped too, so a real one is far smaller).
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024


async def fetch_document(host: str, port: int, timeout: float) -> dict[str, Any]:
    """GET /status.json from an admin port (plain HTTP on loopback, as `up` runs them)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(
                f"GET /status.json HTTP/1.1\r\nHost: {host}:{port}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            data = await reader.read(MAX_DOCUMENT_BYTES + 1)
            while len(data) <= MAX_DOCUMENT_BYTES:
                more = await reader.read(MAX_DOCUMENT_BYTES + 1 - len(data))
                if not more:
                    break
                data += more
        finally:
            writer.close()
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"status document over {MAX_DOCUMENT_BYTES} bytes")
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1:2]
    if status != [b"200"]:
        raise ValueError(f"HTTP {status[0].decode() if status else '?'}")
    document = json.loads(body)
    if not isinstance(document, dict) or not isinstance(document.get("services"), list):
        raise ValueError("not a status document")
    return document


class GatheredStatus:
    """One document from several processes' admin ports (`waygate up`'s page), in
    the order given; a process that does not answer shows its error instead."""

    def __init__(
        self,
        title: str,
        processes: Sequence[tuple[str, str, int]],
        *,
        timeout: float = 2.0,
        sections: Provider | None = None,
    ) -> None:
        self.title = title
        self.processes = list(processes)  # (name, host, admin port)
        self.timeout = timeout
        self._sections = sections

    async def _one(self, name: str, host: str, port: int) -> list[dict[str, Any]]:
        address = f"admin http://{host}:{port}/"
        try:
            document = await fetch_document(host, port, self.timeout)
        except (OSError, TimeoutError, ValueError) as exc:
            reason = str(exc) or type(exc).__name__
            return [{"service": name, "address": address, "error": f"no status: {reason}"}]
        return [{**entry, "address": address} for entry in document["services"]]

    async def document(self) -> dict[str, Any]:
        gathered = await asyncio.gather(*(self._one(*p) for p in self.processes))
        services = [entry for entries in gathered for entry in entries]
        if self._sections is not None:
            own = [section.to_json() for section in self._sections()]
            services.insert(0, {"service": "up", "sections": own})
        return {"title": self.title, "generated": time.time(), "services": services}
