"""The tunnel's data-port grammar: every line on a data connection, as one sans-IO codec.

Who sends what (a data connection is mTLS to a replica's data port, or plain in the
development mode; `waygate.tunnel.datapath` serves it, `relay.Link.read_line` reads
the lines). Lines are ASCII words separated by one space, ended by LF, at most
`PREAMBLE_LIMIT` bytes with the LF; a longer one is refused however it arrives.

    replica, first, to everyone:      WAYGATE <server-id>
    (then, to a peer over its idle cap: REFUSED INVALID too many idle data connections)

    agent -> replica, its first line:
        PARK <park-key>                       a pooled connection waiting for a dial
        DATA <token> <connection-id> [SPLICE] the answer to a DIAL_REQ with a token
    replica -> agent, on a parked connection:
        DIAL <host:port> <timeout-ms> <traceparent|-> [<early-length>]
        SPLICE <host:port> <timeout-ms> <traceparent|-> <dialer-sha256>
    agent -> replica, the answer:
        OK <connection-id> [SPLICE]           SPLICE: agreed to TLS end to end
        REFUSED <REASON> <message>

    dialer -> replica, its first line:
        DIAL <node> <host|-> <port> <timeout-ms> <traceparent|-> [<early-length> <once|replay>]
        SPLICE <node> <host|-> <port> <timeout-ms> <traceparent|->
    replica -> dialer, the answer:
        OK <server-id> <agent-id> <connection-id> [<agent-sha256>]
        REFUSED <REASON> <message>

REASON is a `RefusalReason` name (NOT_ALLOWED, UNREACHABLE, NO_AGENT, TIMEOUT,
DRAINING, INVALID); the message is the rest of the line. `host` `-` is the agent's
default (127.0.0.1); `traceparent` `-` is none. Early data: a DIAL line with a length
(1..`early.EARLY_LIMIT`) is followed by exactly that many bytes, in the same write;
`once|replay` is the dialer's word on whether they may be delivered twice
(`waygate.tunnel.early` has what each answer means for them). After OK the bytes of
the tunnelled connection follow; after REFUSED the connection closes.

Older peers, and how each is treated:
- A replica from before early data or SPLICE answers such a line
  `REFUSED INVALID unknown preamble` (`Refusal.asks_older_form`): nothing was dialled;
  the dialer sends the plain DIAL line (the early bytes after the answer) and
  remembers that listener.
- An agent from before early data or SPLICE drops a parked connection whose dial
  line it cannot read (it expects four words): the replica sees the connection end
  unanswered and carries the dial on the Connect stream (DIAL_REQ).
- An agent that cannot leave TLS answers a SPLICE with a plain `OK <connection-id>`:
  the dial is relayed, and the dialer tells by the four-word OK.
- An agent from before parking sends no PARK line: its dials go as DIAL_REQ.

Malformed input: every parser raises `Malformed`, whose message is what the peer is
told (`REFUSED INVALID <message>`); a line of unknown shape is `unknown preamble`,
the words older peers rely on. A dial whose target is unusable (a port out of range,
a timeout that is not milliseconds) still parses (`Dial.invalid` names the problem),
so the replica reads its early data and applies its dialer policy before refusing it.

Invariants: no I/O, no asyncio, no grpc; fixed lines are precomputed bytes; one
decode and one split per line parsed. Lines are per dial, never per chunk: after OK
nothing here runs for the connection's bytes.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from waygate.tunnel.early import EARLY_LIMIT
from waygate.tunnel.v1 import tunnel_pb2 as pb

PREAMBLE_LIMIT: Final = 4096
# A refusal's message is cut here, so the line stays far inside PREAMBLE_LIMIT.
MESSAGE_LIMIT: Final = 1024
UNKNOWN_PREAMBLE: Final = "unknown preamble"
TOO_LONG: Final = f"a preamble line is at most {PREAMBLE_LIMIT} bytes"

_REASON_NAMES: Final = {value: name for name, value in pb.RefusalReason.items() if value}
_REASONS: Final = {name: value for value, name in _REASON_NAMES.items()}


class Malformed(ValueError):
    """A line outside the grammar; the message is what the peer is told (REFUSED INVALID)."""


# ---------------------------------------------------------------- what a line says


class Park(NamedTuple):
    key: str


class Data(NamedTuple):
    token: str
    connect_id: int
    splice: bool


class Dial(NamedTuple):
    """A dialer's DIAL or SPLICE line. `invalid`: why its target cannot be dialled ("":
    it can); the line itself parsed, so its early data is there to be read."""

    node: str
    host: str  # "": the agent's default
    port: int
    timeout_ms: int
    traceparent: str  # "": none
    early_length: int
    replay: bool
    splice: bool
    invalid: str


class AgentDial(NamedTuple):
    """The replica's DIAL or SPLICE line on a parked connection."""

    address: str
    timeout_ms: int
    traceparent: str  # "": none
    early_length: int
    dialer_sha256: str  # SPLICE's; "" for DIAL


class Accepted(NamedTuple):
    """The replica's OK to a dialer; `agent_sha256` set when the dial is spliced end to end."""

    server_id: str
    agent_id: str
    connect_id: int
    agent_sha256: str


class AgentAccepted(NamedTuple):
    connect_id: int
    splice: bool


class Refusal(NamedTuple):
    reason: int  # a RefusalReason; 0 for a name this side does not know
    name: str
    message: str

    @property
    def asks_older_form(self) -> bool:
        """A peer that does not take this line (from before it): nothing was dialled."""
        return self.name == "INVALID" and self.message == UNKNOWN_PREAMBLE


# ---------------------------------------------------------------- encoding


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _line(*words: str) -> bytes:
    return (" ".join(words) + "\n").encode("utf-8", "replace")


def is_word(text: str) -> bool:
    """Whether `text` can be one word of a line (an agent id, a node, a host)."""
    return bool(text) and " " not in text and "\n" not in text and "\r" not in text


def _word(text: str, what: str) -> str:
    if not is_word(text):
        raise Malformed(f"a dial's {what} must be one word without spaces, not {text[:80]!r}")
    return text


def format_address(host: str, port: int) -> str:
    """The `<host:port>` word of an agent's dial (and a DIAL_REQ's address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of a `format_address` word; Malformed otherwise."""
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not _digits(port_text) or not 0 < int(port_text) < 65536:
        raise Malformed("malformed address")
    return host, int(port_text)


def greeting(server_id: str) -> bytes:
    return b"WAYGATE " + server_id.encode("ascii") + b"\n"


def park(key: str) -> bytes:
    return b"PARK " + key.encode("ascii") + b"\n"


def data(token: str, connect_id: int, splice: bool = False) -> bytes:
    return (
        _line("DATA", token, str(connect_id), "SPLICE")
        if splice
        else _line("DATA", token, str(connect_id))
    )


def dial(
    node: str,
    host: str,
    port: int,
    timeout_ms: int,
    traceparent: str = "",
    early_length: int = 0,
    replay: bool = False,
    splice: bool = False,
) -> bytes:
    """A dialer's DIAL line (with `early_length`, the caller writes the bytes after it,
    in the same write), or its SPLICE line (`splice`; never with early data)."""
    words = [
        "SPLICE" if splice else "DIAL",
        _word(node, "node"),
        _word(host, "host") if host else "-",
        str(port),
        str(timeout_ms),
        traceparent or "-",
    ]
    if early_length:
        if splice:
            raise Malformed("a SPLICE dial carries no early data")
        words += (str(early_length), "replay" if replay else "once")
    return _line(*words)


def agent_dial(
    address: str,
    timeout_ms: int,
    traceparent: str = "",
    early_length: int = 0,
    dialer_sha256: str = "",
) -> bytes:
    """The replica's dial on a parked connection: SPLICE when `dialer_sha256` is given."""
    if dialer_sha256:
        return _line("SPLICE", address, str(timeout_ms), traceparent or "-", dialer_sha256)
    if early_length:
        return _line("DIAL", address, str(timeout_ms), traceparent or "-", str(early_length))
    return _line("DIAL", address, str(timeout_ms), traceparent or "-")


def accepted(server_id: str, agent_id: str, connect_id: int, agent_sha256: str = "") -> bytes:
    if agent_sha256:
        return _line("OK", server_id, agent_id, str(connect_id), agent_sha256)
    return _line("OK", server_id, agent_id, str(connect_id))


def agent_accepted(connect_id: int, splice: bool = False) -> bytes:
    return b"OK " + str(connect_id).encode("ascii") + (b" SPLICE\n" if splice else b"\n")


def refused(reason: int, message: str) -> bytes:
    """REFUSED <REASON> <message>: one line whatever the message holds, cut at MESSAGE_LIMIT."""
    name = _REASON_NAMES.get(reason, "UNREACHABLE")
    text = message[:MESSAGE_LIMIT].replace("\r", " ").replace("\n", " ")
    return _line("REFUSED", name, text)


UNKNOWN_PREAMBLE_LINE: Final = refused(pb.INVALID, UNKNOWN_PREAMBLE)
TOO_LONG_LINE: Final = refused(pb.INVALID, TOO_LONG)
TOO_MANY_IDLE_LINE: Final = refused(pb.INVALID, "too many idle data connections")


# ---------------------------------------------------------------- parsing


def _words(line: bytes) -> list[str]:
    if len(line) >= PREAMBLE_LIMIT:
        raise Malformed(TOO_LONG)
    try:
        return line.decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise Malformed("a preamble line is ASCII") from None


def parse_greeting(line: bytes) -> str:
    """The replica's server id from its first line."""
    words = line.decode("ascii", "replace").split(" ")
    if len(words) != 2 or words[0] != "WAYGATE" or not words[1]:
        raise Malformed(f"not a tunnel data listener (it said {line[:80]!r})")
    return words[1]


def parse_early_length(text: str) -> int:
    """The early-data length word of a DIAL line."""
    if not _digits(text) or not 0 < int(text) <= EARLY_LIMIT:
        raise Malformed(
            f"early data must be 1..{EARLY_LIMIT} bytes, not {text[:12]!r} "
            "(larger first bytes go after the dial's answer)"
        )
    return int(text)


def parse_opening(line: bytes) -> Park | Data | Dial:
    """A client's first line on the data port (an agent's PARK or DATA, a dialer's DIAL or
    SPLICE). Malformed(UNKNOWN_PREAMBLE) for any other shape, so that an older dialer
    falls back as it would with an older replica."""
    words = _words(line)
    verb, count = words[0], len(words)
    if verb == "PARK" and count == 2 and words[1]:
        return Park(words[1])
    if verb == "DATA" and (count == 3 or (count == 4 and words[3] == "SPLICE")):
        if words[1] and words[2].isdigit():  # (an ASCII line: 0-9)
            return Data(words[1], int(words[2]), count == 4)
    elif (verb == "DIAL" and count in (6, 8)) or (verb == "SPLICE" and count == 6):
        return _dial(words)
    raise Malformed(UNKNOWN_PREAMBLE)


def _dial(words: list[str]) -> Dial:
    # (words of an ASCII line: str.isdigit means 0-9 here)
    _verb, node, host, port_text, timeout_text, traceparent = words[:6]
    early_length, replay = 0, False
    if len(words) == 8:
        early_length = parse_early_length(words[6])
        if words[7] not in ("once", "replay"):
            raise Malformed(f"early data is 'once' or 'replay', not {words[7][:12]!r}")
        replay = words[7] == "replay"
    invalid = ""
    port = int(port_text) if port_text.isdigit() else 0
    if not node or not 0 < port < 65536:
        invalid, port = "a dial target needs a node and a port 1..65535", 0
    elif not timeout_text.isdigit():
        invalid = "the dial timeout must be milliseconds"
    return Dial(
        node,
        "" if host == "-" else host,
        port,
        int(timeout_text) if timeout_text.isdigit() else 0,
        "" if traceparent == "-" else traceparent,
        early_length,
        replay,
        words[0] == "SPLICE",
        invalid,
    )


def parse_agent_dial(line: bytes) -> AgentDial:
    """The replica's line on a parked connection (the agent's side)."""
    words = _words(line)
    verb, count = words[0], len(words)
    if not ((verb == "DIAL" and count in (4, 5)) or (verb == "SPLICE" and count == 5)):
        raise Malformed(f"not a dial: {line[:80]!r}")
    _verb, address, timeout_text, traceparent = words[:4]
    if not timeout_text.isdigit():
        raise Malformed(f"the dial timeout must be milliseconds, not {timeout_text[:12]!r}")
    if not address:
        raise Malformed("malformed address")
    early_length = parse_early_length(words[4]) if verb == "DIAL" and count == 5 else 0
    return AgentDial(
        address,
        int(timeout_text),
        "" if traceparent == "-" else traceparent,
        early_length,
        words[4] if verb == "SPLICE" else "",
    )


def _refusal(line: bytes, rest: str) -> Refusal:
    name, _, message = rest.partition(" ")
    if not name:
        raise Malformed(f"a refusal without its reason: {line[:80]!r}")
    return Refusal(_REASONS.get(name, 0), name, message)


def parse_answer(line: bytes, splice: bool = False) -> Accepted | Refusal:
    """The replica's answer to a dialer's line. `splice`: the dialer asked for TLS end to
    end, so a fifth word (the agent's certificate) means the agent agreed."""
    verb, _, rest = line.decode("utf-8", "replace").partition(" ")
    if verb == "REFUSED":
        return _refusal(line, rest)
    if verb == "OK":
        words = rest.split(" ")
        if len(words) in (3, 4) and _digits(words[2]) and words[0] and words[1]:
            spliced = splice and len(words) == 4 and words[3]
            return Accepted(words[0], words[1], int(words[2]), words[3] if spliced else "")
    raise Malformed(f"the tunnel server answered {line[:80]!r}")


def parse_agent_answer(line: bytes, splice: bool = False) -> AgentAccepted | Refusal:
    """The agent's answer on a parked connection. `splice`: the replica asked for TLS end
    to end (SPLICE), so `OK <id> SPLICE` means the agent agreed."""
    verb, _, rest = line.decode("utf-8", "replace").partition(" ")
    if verb == "REFUSED":
        return _refusal(line, rest)
    if verb == "OK":
        if _digits(rest):
            return AgentAccepted(int(rest), False)
        if splice and rest.endswith(" SPLICE") and _digits(rest[:-7]):
            return AgentAccepted(int(rest[:-7]), True)
    raise Malformed(f"the agent answered {line[:80]!r}")
