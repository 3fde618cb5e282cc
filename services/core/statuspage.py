"""The admin port's status page: `/` (HTML) and `/status.json` (the same data).

`/status.json` is data with a documented schema (docs/status-json.md, `SCHEMA`):
numbers are JSON numbers, times RFC 3339 strings (UTC, `Z`); the page renders
everything it shows from it (relative times included), and other tools
(`waygate check`) read it.

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
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: Rows one section may show; the rest are counted in its note.
MAX_ROWS = 500
#: The document's schema (docs/status-json.md); a change that breaks readers bumps it.
SCHEMA = "waygate.status/v1"
#: The window the summary's requests per second are measured over.
RATE_WINDOW = 60.0

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


def rfc3339(when: datetime | float) -> str:
    """A time as the document spells it: RFC 3339, UTC, seconds, `Z`."""
    if not isinstance(when, datetime):
        when = datetime.fromtimestamp(when, UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def time_cell(when: datetime | None, state: str = "", *, empty: str = "") -> Any:
    """A point in time: `{"time": RFC 3339}`, shown by the page as "5s ago" (or
    "in 3d") with the time itself as its tooltip; `empty` when there is none."""
    if when is None:
        return empty
    value: dict[str, Any] = {"time": rfc3339(when)}
    if state:
        value["state"] = state
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


@dataclass(frozen=True)
class Traffic:
    """Counters of a process that answers requests (the proxy), for the summary line:
    every request answered, those answered 5xx, and those no route took."""

    requests: int
    errors_5xx: int
    unrouted: int


class RequestRate:
    """Requests per second over the last `RATE_WINDOW` seconds, from the totals seen
    at each document (the page polls every 2 s; None until 1 s has been seen)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()

    def observe(self, requests: int) -> float | None:
        now = self._clock()
        samples = self._samples
        if samples and requests < samples[-1][1]:
            samples.clear()  # the counters started over (a restarted process)
        samples.append((now, requests))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW:
            samples.popleft()
        first_time, first_requests = samples[0]
        span = now - first_time
        return round((requests - first_requests) / span, 3) if span >= 1.0 else None


def summary_of(traffic: Traffic, per_second: float | None) -> dict[str, Any]:
    return {
        "requests": traffic.requests,
        "errors_5xx": traffic.errors_5xx,
        "unrouted": traffic.unrouted,
        "per_second": per_second,
    }


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
        self._traffic: Callable[[], Traffic] | None = None
        self._rate = RequestRate()

    def add(self, name: str, provider: Provider) -> None:
        """Sections from `provider`, after those added before (`name` is for errors)."""
        self._providers.append((name, provider))

    def set_traffic(self, traffic: Callable[[], Traffic]) -> None:
        """The counters of the document's summary line (a process that serves traffic)."""
        self._traffic = traffic

    def summary(self) -> dict[str, Any] | None:
        if self._traffic is None:
            return None
        try:
            traffic = self._traffic()
        except Exception:  # like a provider: costs the summary, never the page
            log.exception("status summary failed")
            return None
        return summary_of(traffic, self._rate.observe(traffic.requests))

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
        document: dict[str, Any] = {
            "schema": SCHEMA,
            "title": f"Waygate {self.service}",
            "generated": rfc3339(time.time()),
            "services": [self.service_document()],
        }
        summary = self.summary()
        if summary is not None:
            document["summary"] = summary
        return document


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

    async def _one(
        self, name: str, host: str, port: int
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        address = f"admin http://{host}:{port}/"
        try:
            document = await fetch_document(host, port, self.timeout)
        except (OSError, TimeoutError, ValueError) as exc:
            reason = str(exc) or type(exc).__name__
            return [{"service": name, "address": address, "error": f"no status: {reason}"}], None
        summary = document.get("summary")
        return (
            [{**entry, "address": address} for entry in document["services"]],
            summary if isinstance(summary, dict) else None,
        )

    async def document(self) -> dict[str, Any]:
        gathered = await asyncio.gather(*(self._one(*p) for p in self.processes))
        services = [entry for entries, _ in gathered for entry in entries]
        if self._sections is not None:
            own = [section.to_json() for section in self._sections()]
            services.insert(0, {"service": "up", "sections": own})
        document: dict[str, Any] = {
            "schema": SCHEMA,
            "title": self.title,
            "generated": rfc3339(time.time()),
            "services": services,
        }
        summaries = [summary for _, summary in gathered if summary is not None]
        if summaries:
            document["summary"] = _added(summaries)
        return document


def _added(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several processes' summaries as one: counts and rates added."""
    total: dict[str, Any] = {
        key: sum(int(s.get(key) or 0) for s in summaries)
        for key in ("requests", "errors_5xx", "unrouted")
    }
    rates = [s["per_second"] for s in summaries if isinstance(s.get("per_second"), int | float)]
    total["per_second"] = round(sum(rates), 3) if rates else None
    return total
