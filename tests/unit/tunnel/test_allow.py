"""The agent's destination allow-list and the credit window (sans-IO)."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from waygate.tunnel.allow import AllowList, entries_problem, node_addresses, parse_entry
from waygate.tunnel.mux import ConnectionClosed, Credit


def test_default_is_the_nodes_own_addresses_on_the_kubelet_port() -> None:
    own = (ipaddress.ip_address("10.1.2.3"), ipaddress.ip_address("fd00::7"))
    allow = AllowList(["node:10250"], own=own)
    assert allow.allows("10.1.2.3", 10250)
    assert allow.allows("fd00::7", 10250)
    assert not allow.allows("10.1.2.3", 22)
    assert not allow.allows("10.1.2.4", 10250)
    assert not allow.allows("not-an-address", 10250)


def test_cidrs_port_lists_and_any_port() -> None:
    allow = AllowList(["10.0.0.0/8:80+443", "127.0.0.1:8090", "[fd00::]/8:*"], own=())
    assert allow.allows("10.200.0.1", 443)
    assert not allow.allows("10.200.0.1", 8443)
    assert allow.allows("127.0.0.1", 8090)
    assert not allow.allows("127.0.0.2", 8090)
    assert allow.allows("fd12::1", 1)


def test_ipv4_mapped_addresses_are_judged_as_ipv4() -> None:
    allow = AllowList(["127.0.0.0/8:8090"], own=())
    assert allow.allows("::ffff:127.0.0.1", 8090)
    assert not allow.allows("::ffff:10.0.0.1", 8090)


@pytest.mark.parametrize(
    "entry", ["10.0.0.0/8", "nonsense:80", "10.0.0.0/8:0", "10.0.0.0/8:http", ":80"]
)
def test_bad_entries_are_explained(entry: str) -> None:
    with pytest.raises(ValueError):
        parse_entry(entry)
    assert entries_problem([entry])


def test_this_host_has_addresses() -> None:
    assert ipaddress.ip_address("127.0.0.1") in node_addresses()


async def test_credit_waits_for_a_grant_and_wakes_on_close() -> None:
    credit = Credit(10)
    await credit.take(10)
    waiting = asyncio.ensure_future(credit.take(5))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    credit.grant(4)
    await asyncio.sleep(0.01)
    assert not waiting.done()  # 4 < 5: still waiting
    credit.grant(1)
    await asyncio.wait_for(waiting, 10)
    assert credit.available == 0
    blocked = asyncio.ensure_future(credit.take(1))
    await asyncio.sleep(0.01)
    credit.close()
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(blocked, 1)


def test_credit_never_exceeds_its_limit_whatever_the_peer_grants() -> None:
    credit = Credit(10 * 1024 * 1024, limit=1024)  # a peer claiming a 10 MiB window
    assert credit.available == 1024
    credit.grant(1 << 40)  # and granting a terabyte
    assert credit.available == 1024


def test_remembered_verdicts_stay_right_and_the_table_stays_bounded() -> None:
    from waygate.tunnel.allow import VERDICTS

    allow = AllowList(["10.0.0.0/8:80"], own=())
    for _ in range(2):  # the second round answers from the table
        assert allow.allows("10.0.0.1", 80)
        assert not allow.allows("10.0.0.1", 81)
        assert not allow.allows("11.0.0.1", 80)
        assert not allow.allows("not-an-address", 80)
    for n in range(VERDICTS * 2 + 3):
        address = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        assert allow.allows(address, 80)
        assert not allow.allows(address, 443)
        assert len(allow._verdicts) <= VERDICTS
    assert not allow.allows("11.0.0.1", 80)
