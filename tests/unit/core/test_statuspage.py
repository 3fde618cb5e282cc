"""The status page's document: cells, expiry bars, bounded sections, and a
provider that fails costing only its own sections."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from waygate.core import statuspage
from waygate.core.statuspage import Section, StatusPage, cell, duration_text, expiry_cell

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


def test_durations_read_as_people_say_them():
    assert duration_text(42) == "42s"
    assert duration_text(5 * 60 + 3) == "5m 3s"
    assert duration_text(3 * 3600 + 61) == "3h 1m"
    assert duration_text(3 * 86400 + 4 * 3600 + 59) == "3d 4h"
    assert duration_text(-90) == "expired 1m 30s ago"


def test_an_expiry_bar_is_the_share_of_the_lifetime_left_coloured_by_how_soon():
    start = NOW - timedelta(hours=12)
    half = expiry_cell(NOW + timedelta(hours=12), start, now=NOW)
    assert half["bar"] == 0.5 and half["state"] == "ok" and half["text"] == "12h 0m"
    assert "2026-11-27T00:00:00+00:00" in half["title"]
    # Renewal is due at 70% used: under 30% left warns, under 10% is bad.
    assert expiry_cell(NOW + timedelta(hours=4), NOW - timedelta(hours=20), now=NOW)["state"] == (
        "warn"
    )
    gone = expiry_cell(NOW - timedelta(minutes=1), NOW - timedelta(days=1), now=NOW)
    assert gone["state"] == "bad" and gone["bar"] == 0.0 and gone["text"].startswith("expired")
    # Unknown start (a CA read from a bundle): measured against 30 days.
    assert expiry_cell(NOW + timedelta(days=15), now=NOW)["bar"] == 0.5


def test_a_section_shows_at_most_max_rows_and_says_how_many_more(monkeypatch):
    monkeypatch.setattr(statuspage, "MAX_ROWS", 3)
    section = Section("Routes", ["route"], [[f"r{i}"] for i in range(5)], note="served")
    document = section.to_json()
    assert document["rows"] == [["r0"], ["r1"], ["r2"]]
    assert document["note"].startswith("served; 2 more not shown")


async def test_a_failing_provider_costs_its_own_sections_only():
    page = StatusPage("proxy", lambda: (False, "starting"))

    def broken() -> list[Section]:
        raise KeyError("gone")

    page.add("broken", broken)
    page.add("fine", lambda: [Section("Fine", ["a"], [[cell(1, "ok")]])])
    document = await page.document()
    assert document["title"] == "Waygate proxy"
    (service,) = document["services"]
    assert (service["service"], service["ready"], service["reason"]) == ("proxy", False, "starting")
    error, fine = service["sections"]
    assert error["title"] == "broken" and "KeyError" in error["rows"][0][0]["text"]
    assert error["rows"][0][0]["state"] == "bad"
    assert fine["rows"] == [[{"text": 1, "state": "ok"}]]


def test_the_page_is_one_self_contained_file():
    html = statuspage.page_html().decode()
    assert 'fetch("status.json"' in html
    # Nothing from elsewhere: no external script, style sheet, font or image.
    for marker in ("http://", "https://", "src=", "<link", "@import", "url("):
        assert marker not in html, marker


async def test_the_document_is_data_with_a_schema_numbers_and_rfc3339_times():
    """Issue 29 deliverable 5: docs/status-json.md's types."""
    import re

    from waygate.core.statuspage import SCHEMA, Traffic, time_cell

    page = StatusPage("proxy")
    page.add("t", lambda: [Section("T", ["when"], [[time_cell(NOW, "ok")], [time_cell(None)]])])
    totals = Traffic(requests=10, errors_5xx=2, unrouted=1)
    page.set_traffic(lambda: totals)
    document = await page.document()
    assert document["schema"] == SCHEMA == "waygate.status/v1"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", document["generated"])
    assert document["summary"] == {
        "requests": 10,
        "errors_5xx": 2,
        "unrouted": 1,
        "per_second": None,  # no second seen yet
    }
    (section,) = document["services"][0]["sections"]
    assert section["rows"] == [[{"time": "2026-11-26T12:00:00Z", "state": "ok"}], [""]]
    # A page without traffic has no summary at all.
    assert "summary" not in await StatusPage("certs").document()


def test_requests_per_second_are_measured_over_the_last_minute():
    from waygate.core.statuspage import RequestRate

    now = [0.0]
    rate = RequestRate(lambda: now[0])
    assert rate.observe(0) is None
    now[0] = 0.5
    assert rate.observe(5) is None  # under a second seen
    now[0] = 2.0
    assert rate.observe(20) == 10.0
    for second in range(3, 200):
        now[0] = float(second)
        value = rate.observe(20 + (second - 2) * 3)
    assert value == 3.0  # the first burst left the window
    now[0] = 201.0
    assert rate.observe(4) is None  # counters started over (a restart): measured anew


def test_gathered_summaries_add_up():
    from waygate.core.statuspage import _added

    total = _added(
        [
            {"requests": 5, "errors_5xx": 1, "unrouted": 0, "per_second": 1.5},
            {"requests": 7, "errors_5xx": 0, "unrouted": 3, "per_second": None},
        ]
    )
    assert total == {"requests": 12, "errors_5xx": 1, "unrouted": 3, "per_second": 1.5}
