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
