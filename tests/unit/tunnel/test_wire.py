"""The data-port grammar (`waygate.tunnel.wire`), line by line (issue 28 item 7).

Every line each party writes is encoded and parsed back to what was meant; every
malformed line gets `Malformed` with a message fit to send back (REFUSED INVALID ...),
never another exception; and the lines older peers send or expect keep their exact
bytes (the compatibility the tunnel's integration tests check end to end).
"""

from __future__ import annotations

from typing import Any

import pytest

from waygate.tunnel import wire
from waygate.tunnel.early import EARLY_LIMIT
from waygate.tunnel.v1 import tunnel_pb2 as pb

SHA = "ab" * 32
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

# (what is encoded, its exact bytes, the parser, what it parses to)
ROUND_TRIPS: list[tuple[str, bytes, bytes, Any, Any]] = [
    ("greeting", wire.greeting("replica-a"), b"WAYGATE replica-a\n", wire.parse_greeting,
     "replica-a"),
    ("park", wire.park("k3y_-x"), b"PARK k3y_-x\n", wire.parse_opening, wire.Park("k3y_-x")),
    ("data", wire.data("t0ken", 42), b"DATA t0ken 42\n", wire.parse_opening,
     wire.Data("t0ken", 42, False)),
    ("data splice", wire.data("t0ken", 42, splice=True), b"DATA t0ken 42 SPLICE\n",
     wire.parse_opening, wire.Data("t0ken", 42, True)),
    ("dial", wire.dial("edge-1", "", 10250, 5000), b"DIAL edge-1 - 10250 5000 -\n",
     wire.parse_opening, wire.Dial("edge-1", "", 10250, 5000, "", 0, False, False, "")),
    ("dial host traced", wire.dial("edge-1", "10.0.0.9", 80, 1, TRACEPARENT),
     f"DIAL edge-1 10.0.0.9 80 1 {TRACEPARENT}\n".encode(), wire.parse_opening,
     wire.Dial("edge-1", "10.0.0.9", 80, 1, TRACEPARENT, 0, False, False, "")),
    ("dial early once", wire.dial("edge-1", "::1", 80, 900, early_length=37),
     b"DIAL edge-1 ::1 80 900 - 37 once\n", wire.parse_opening,
     wire.Dial("edge-1", "::1", 80, 900, "", 37, False, False, "")),
    ("dial early replay", wire.dial("n", "", 80, 900, early_length=EARLY_LIMIT, replay=True),
     f"DIAL n - 80 900 - {EARLY_LIMIT} replay\n".encode(), wire.parse_opening,
     wire.Dial("n", "", 80, 900, "", EARLY_LIMIT, True, False, "")),
    ("splice", wire.dial("edge-1", "", 22, 3000, splice=True), b"SPLICE edge-1 - 22 3000 -\n",
     wire.parse_opening, wire.Dial("edge-1", "", 22, 3000, "", 0, False, True, "")),
    ("agent dial", wire.agent_dial("127.0.0.1:80", 4999), b"DIAL 127.0.0.1:80 4999 -\n",
     wire.parse_agent_dial, wire.AgentDial("127.0.0.1:80", 4999, "", 0, "")),
    ("agent dial early", wire.agent_dial("[::1]:80", 10, TRACEPARENT, 5),
     f"DIAL [::1]:80 10 {TRACEPARENT} 5\n".encode(), wire.parse_agent_dial,
     wire.AgentDial("[::1]:80", 10, TRACEPARENT, 5, "")),
    ("agent splice", wire.agent_dial("127.0.0.1:22", 10, "", 0, SHA),
     f"SPLICE 127.0.0.1:22 10 - {SHA}\n".encode(), wire.parse_agent_dial,
     wire.AgentDial("127.0.0.1:22", 10, "", 0, SHA)),
    ("accepted", wire.accepted("replica-a", "agent-1", 7), b"OK replica-a agent-1 7\n",
     wire.parse_answer, wire.Accepted("replica-a", "agent-1", 7, "")),
    ("agent accepted", wire.agent_accepted(7), b"OK 7\n", wire.parse_agent_answer,
     wire.AgentAccepted(7, False)),
    ("refused", wire.refused(pb.NO_AGENT, "no agent for node edge-1"),
     b"REFUSED NO_AGENT no agent for node edge-1\n", wire.parse_answer,
     wire.Refusal(pb.NO_AGENT, "NO_AGENT", "no agent for node edge-1")),
    ("agent refused", wire.refused(pb.NOT_ALLOWED, "not in the allow-list"),
     b"REFUSED NOT_ALLOWED not in the allow-list\n", wire.parse_agent_answer,
     wire.Refusal(pb.NOT_ALLOWED, "NOT_ALLOWED", "not in the allow-list")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("encoded", "expected", "parse", "meant"),
    [case[1:] for case in ROUND_TRIPS],
    ids=[case[0] for case in ROUND_TRIPS],
)
def test_every_line_encodes_to_its_bytes_and_parses_back(
    encoded: bytes, expected: bytes, parse: Any, meant: Any
) -> None:
    assert encoded == expected
    assert len(encoded) <= wire.PREAMBLE_LIMIT
    assert parse(encoded[:-1]) == meant  # (read_line hands lines on without their LF)


def test_end_to_end_answers_parse_only_when_asked_for() -> None:
    """A fifth word of OK (the agent's certificate) and `OK <id> SPLICE` mean TLS end to
    end only to the side that asked for it; the plain OK to a SPLICE means relayed."""
    ok = wire.accepted("replica-a", "agent-1", 7, SHA)
    assert ok == f"OK replica-a agent-1 7 {SHA}\n".encode()
    assert wire.parse_answer(ok[:-1], splice=True) == wire.Accepted("replica-a", "agent-1", 7, SHA)
    assert wire.parse_answer(ok[:-1]).agent_sha256 == ""  # type: ignore[union-attr]
    plain = wire.accepted("replica-a", "agent-1", 7)[:-1]
    assert wire.parse_answer(plain, splice=True) == wire.Accepted("replica-a", "agent-1", 7, "")
    agreed = wire.agent_accepted(7, splice=True)
    assert agreed == b"OK 7 SPLICE\n"
    assert wire.parse_agent_answer(agreed[:-1], splice=True) == wire.AgentAccepted(7, True)
    with pytest.raises(wire.Malformed):
        wire.parse_agent_answer(agreed[:-1])  # never asked: not an answer the replica takes
    assert wire.parse_agent_answer(b"OK 7", splice=True) == wire.AgentAccepted(7, False)


def test_what_older_peers_rely_on_keeps_its_bytes() -> None:
    """A replica from before early data or SPLICE answers `REFUSED INVALID unknown
    preamble`, which dialers take as "send the older line"; the fixed lines are
    precomputed bytes."""
    assert wire.UNKNOWN_PREAMBLE_LINE == b"REFUSED INVALID unknown preamble\n"
    said = wire.parse_answer(wire.UNKNOWN_PREAMBLE_LINE[:-1])
    assert isinstance(said, wire.Refusal) and said.asks_older_form
    other = wire.parse_answer(b"REFUSED INVALID the dial timeout must be milliseconds")
    assert isinstance(other, wire.Refusal) and not other.asks_older_form
    assert wire.TOO_MANY_IDLE_LINE == b"REFUSED INVALID too many idle data connections\n"
    assert wire.TOO_LONG_LINE.startswith(b"REFUSED INVALID a preamble line is at most 4096")
    # Lines an older agent or dialer writes parse as they always did.
    assert wire.parse_agent_dial(b"DIAL 127.0.0.1:80 1000 -").early_length == 0
    assert wire.parse_opening(b"DIAL edge-1 - 80 1000 -") == wire.Dial(
        "edge-1", "", 80, 1000, "", 0, False, False, ""
    )


def test_a_refusal_is_one_line_whatever_its_message_holds() -> None:
    line = wire.refused(pb.UNREACHABLE, "connecting to x:\r\n80 failed\n" + "é" * 5000)
    assert line.count(b"\n") == 1 and line.endswith(b"\n") and b"\r" not in line
    assert len(line) <= wire.PREAMBLE_LIMIT
    said = wire.parse_answer(line[:-1])
    assert isinstance(said, wire.Refusal) and said.reason == pb.UNREACHABLE
    # A reason this side does not know: reason 0, the name and message kept for the caller.
    assert wire.parse_answer(b"REFUSED OVERLOADED try later") == wire.Refusal(
        0, "OVERLOADED", "try later"
    )


# A client's first line on the data port, and the refusal it gets.
MALFORMED_OPENINGS: list[tuple[bytes, str]] = [
    (b"", wire.UNKNOWN_PREAMBLE),
    (b"HELLO", wire.UNKNOWN_PREAMBLE),
    (b"dial edge-1 - 80 1000 -", wire.UNKNOWN_PREAMBLE),
    (b"PARK", wire.UNKNOWN_PREAMBLE),
    (b"PARK  ", wire.UNKNOWN_PREAMBLE),
    (b"PARK a b", wire.UNKNOWN_PREAMBLE),
    (b"DATA token", wire.UNKNOWN_PREAMBLE),
    (b"DATA token x1", wire.UNKNOWN_PREAMBLE),
    (b"DATA token -1", wire.UNKNOWN_PREAMBLE),
    (b"DATA token 1 RELAY", wire.UNKNOWN_PREAMBLE),
    (b"DATA  1", wire.UNKNOWN_PREAMBLE),
    (b"DIAL edge-1 - 80 1000", wire.UNKNOWN_PREAMBLE),
    (b"DIAL edge-1 - 80 1000 - 5", wire.UNKNOWN_PREAMBLE),
    (b"DIAL edge-1 - 80 1000 - 5 once extra", wire.UNKNOWN_PREAMBLE),
    (b"SPLICE edge-1 - 80 1000 - 5 once", wire.UNKNOWN_PREAMBLE),
    (b"DIAL edge-1 - 80 1000 - 0 once", "early data must be 1..16384 bytes, not '0'"),
    (b"DIAL edge-1 - 80 1000 - 16385 once", "early data must be 1..16384 bytes"),
    (b"DIAL edge-1 - 80 1000 - x once", "early data must be 1..16384 bytes"),
    (b"DIAL edge-1 - 80 1000 - 5 twice", "early data is 'once' or 'replay', not 'twice'"),
    ("DIAL édge - 80 1000 -".encode(), "a preamble line is ASCII"),
    (b"DIAL \xff - 80 1000 -", "a preamble line is ASCII"),
    (b"DIAL " + b"x" * wire.PREAMBLE_LIMIT + b" - 80 1000 -", wire.TOO_LONG),
]


@pytest.mark.parametrize(("line", "refusal"), MALFORMED_OPENINGS)
def test_a_malformed_opening_is_refused_with_its_reason(line: bytes, refusal: str) -> None:
    with pytest.raises(wire.Malformed) as refused:
        wire.parse_opening(line)
    assert str(refused.value).startswith(refusal)
    # What the peer is told fits on one line.
    answer = wire.refused(pb.INVALID, str(refused.value))
    assert answer.count(b"\n") == 1 and len(answer) <= wire.PREAMBLE_LIMIT


# A dial whose line parses but whose target cannot be dialled: the replica reads its
# early data and applies its dialer policy first, then refuses with this.
UNUSABLE_TARGETS: list[tuple[bytes, str]] = [
    (b"DIAL edge-1 - 0 1000 -", "a dial target needs a node and a port 1..65535"),
    (b"DIAL edge-1 - 65536 1000 -", "a dial target needs a node and a port 1..65535"),
    (b"DIAL edge-1 - http 1000 -", "a dial target needs a node and a port 1..65535"),
    (b"DIAL  - 80 1000 -", "a dial target needs a node and a port 1..65535"),
    (b"DIAL edge-1 - 80 soon -", "the dial timeout must be milliseconds"),
    (b"DIAL edge-1 - 80 -5 - 5 once", "the dial timeout must be milliseconds"),
    (b"SPLICE edge-1 - 99999 1000 -", "a dial target needs a node and a port 1..65535"),
]


@pytest.mark.parametrize(("line", "invalid"), UNUSABLE_TARGETS)
def test_an_unusable_target_parses_and_says_why(line: bytes, invalid: str) -> None:
    dial = wire.parse_opening(line)
    assert isinstance(dial, wire.Dial)
    assert dial.invalid == invalid
    if line.endswith(b" once"):
        assert dial.early_length == 5  # still there to be read before the refusal


def _agent_answer(line: bytes) -> Any:
    return wire.parse_agent_answer(line, splice=True)


# What every other reader refuses: (the reader, the line, what its refusal says).
MALFORMED_LINES: list[tuple[Any, bytes, str]] = [
    *((wire.parse_agent_dial, line, "not a dial|early data|milliseconds|malformed|ASCII") for line in (
        b"",
        b"DIAL",
        b"DIAL 127.0.0.1:80 1000",
        b"DIAL 127.0.0.1:80 soon -",
        b"DIAL 127.0.0.1:80 1000 - 0",
        b"DIAL 127.0.0.1:80 1000 - 99999",
        b"DIAL 127.0.0.1:80 1000 - 5 once",
        b"DIAL  1000 -",
        b"SPLICE 127.0.0.1:80 1000 -",
        b"SPLICE 127.0.0.1:80 1000 - sha extra",
        b"PARK key",
        b"REFUSED INVALID too many idle data connections",
        b"DIAL \xfe 1000 -",
    )),
    *((wire.parse_answer, line, "the tunnel server answered|a refusal without") for line in (
        b"",
        b"OK",
        b"OK replica-a agent-1",
        b"OK replica-a agent-1 seven",
        b"OK replica-a agent-1 \xd9\xa3",  # an Arabic-Indic digit is a digit to str.isdigit
        b"OK replica-a agent-1 7 sha extra",
        b"OK  agent-1 7",
        b"REFUSED",
        b"REFUSED ",
        b"WAYGATE replica-a",
        b"HTTP/1.1 400 Bad Request",
    )),
    *((_agent_answer, line, "the agent answered|a refusal without") for line in (
        b"",
        b"OK",
        b"OK x",
        b"OK 7 RELAY",
        b"OK 7 8",
        b"OK \xd9\xa3",
        b"REFUSED",
        b"DATA token 7",
    )),
    *((wire.parse_greeting, line, "not a tunnel data listener") for line in (
        b"", b"WAYGATE", b"WAYGATE ", b"WAYGATE a b", b"HTTP/1.1 200 OK", b"SSH-2.0-x"
    )),
]  # fmt: skip


@pytest.mark.parametrize(
    ("parse", "line", "refusal"),
    MALFORMED_LINES,
    ids=[f"{case[0].__name__}-{case[1][:24]!r}" for case in MALFORMED_LINES],
)
def test_every_other_malformed_line_is_refused_with_its_reason(
    parse: Any, line: bytes, refusal: str
) -> None:
    with pytest.raises(wire.Malformed, match=refusal):
        parse(line)


@pytest.mark.parametrize(
    ("node", "host"), [("", "x"), ("edge 1", ""), ("edge-1", "a b"), ("edge\n1", ""), ("e", "\r")]
)
def test_a_dialer_cannot_write_a_word_that_would_split_the_line(node: str, host: str) -> None:
    with pytest.raises(wire.Malformed, match="must be one word"):
        wire.dial(node, host, 80, 1000)


def test_splice_carries_no_early_data() -> None:
    with pytest.raises(wire.Malformed, match="no early data"):
        wire.dial("edge-1", "", 80, 1000, early_length=5, splice=True)


@pytest.mark.parametrize(
    ("address", "parsed"),
    [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:443", ("::1", 443)), ("a.b:1", ("a.b", 1))],
)
def test_addresses_round_trip(address: str, parsed: tuple[str, int]) -> None:
    assert wire.parse_address(address) == parsed
    assert wire.format_address(*parsed) == address


@pytest.mark.parametrize("address", ["", "x", ":80", "h:", "h:0", "h:65536", "h:8x", "h:\u0663"])
def test_a_malformed_address_is_refused(address: str) -> None:
    with pytest.raises(wire.Malformed, match="malformed address"):
        wire.parse_address(address)
