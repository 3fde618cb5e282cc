"""The flow-control helper's rules, against a stand-in transport that counts calls."""

from __future__ import annotations

import asyncio

import pytest

from waygate.core import flow


class CountingTransport:
    """Stand-in for an asyncio transport: records pause/resume calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closing = False

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def is_closing(self) -> bool:
        return self.closing


def test_reasons_pause_once_and_resume_when_the_last_goes() -> None:
    transport = CountingTransport()
    control = flow.FlowControl(transport)
    control.pause(flow.PEER)
    control.pause(flow.PIPELINE)
    control.pause(flow.PEER)
    control.resume(flow.PEER)
    assert transport.calls == ["pause"]
    control.resume(flow.PEER)  # not paused for it any more: nothing
    control.resume(flow.PIPELINE)
    assert transport.calls == ["pause", "resume"]
    assert not control.reading_paused


def test_buffered_bytes_pause_above_high_and_resume_at_low() -> None:
    transport = CountingTransport()
    control = flow.FlowControl(transport, high=100, low=40)
    control.queued(100)
    assert transport.calls == []
    control.queued(1)
    control.queued(50)
    assert transport.calls == ["pause"]
    control.drained(100)  # 51 left: above low
    assert transport.calls == ["pause"]
    control.drained(11)
    assert transport.calls == ["pause", "resume"]


def test_a_closing_transport_is_never_resumed() -> None:
    transport = CountingTransport()
    control = flow.FlowControl(transport)
    control.pause(flow.PEER)
    transport.closing = True
    control.resume(flow.PEER)
    assert transport.calls == ["pause"]


def test_marks_are_checked() -> None:
    with pytest.raises(ValueError, match="low"):
        flow.FlowControl(CountingTransport(), high=10, low=20)


async def test_drain_waits_for_resume_writing_or_close() -> None:
    control = flow.FlowControl(CountingTransport())
    await asyncio.wait_for(control.drain(), 1)  # not paused: returns at once
    control.pause_writing()
    waiter = asyncio.ensure_future(control.drain())
    await asyncio.sleep(0)
    assert not waiter.done()
    control.resume_writing()
    await asyncio.wait_for(waiter, 10)
    control.pause_writing()
    waiter = asyncio.ensure_future(control.drain())
    await asyncio.sleep(0)
    control.closed()
    await asyncio.wait_for(waiter, 10)
