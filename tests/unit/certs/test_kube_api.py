"""The JSON layer over the kubernetes client: paging, watch-event parsing (no sockets).

A `KubeAPI` whose `request` answers from a script stands in for the HTTP
side; a response object whose `stream()` yields given chunks stands in for a
watch connection (the stand-in API server covers the real ones in the
integration tests, but sends each list in one page and each event in one chunk).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client

from waygate.certs.kube_api import KubeAPI, KubeError, WatchStream, _server_message


class ScriptedAPI(KubeAPI):
    def __init__(self, pages: list[dict[str, Any]]) -> None:
        super().__init__(client.ApiClient(client.Configuration()))
        self.pages = pages
        self.queries: list[list[tuple[str, Any]]] = []

    def request(self, method: str, path: str, *, query=None, body=None):  # type: ignore[no-untyped-def]
        self.queries.append(list(query or []))
        return self.pages.pop(0)


def test_list_follows_continue_tokens_and_returns_the_last_version() -> None:
    api = ScriptedAPI(
        [
            {"metadata": {"continue": "page2", "resourceVersion": "10"}, "items": [{"a": 1}]},
            {"metadata": {"resourceVersion": "11"}, "items": [{"a": 2}, {"a": 3}]},
        ]
    )
    items, version = api.list("/x", limit=2)
    assert items == [{"a": 1}, {"a": 2}, {"a": 3}]
    assert version == "11"
    assert api.queries == [[("limit", 2)], [("limit", 2), ("continue", "page2")]]


class ChunkedResponse:
    def __init__(self, chunks: list[bytes], error: Exception | None = None) -> None:
        self.chunks, self.error = chunks, error
        self.closed = self.released = False

    def stream(self, amt: Any = None, decode_content: bool = True) -> Iterator[bytes]:
        yield from self.chunks
        if self.error is not None:
            raise self.error

    def shutdown(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        self.released = True


def line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def test_events_split_across_chunks_are_put_back_together() -> None:
    first = line({"type": "ADDED", "object": {"metadata": {"name": "a"}}})
    second = line({"type": "MODIFIED", "object": {"metadata": {"name": "b"}}})
    data = first + b"\n" + second
    chunks = [data[:7], data[7:40], data[40:]]
    stream = WatchStream(ChunkedResponse(chunks), "/x")  # type: ignore[arg-type]
    events = list(stream.events())
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "a"),
        ("MODIFIED", "b"),
    ]


def test_an_expired_version_is_a_gone_error() -> None:
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    stream = WatchStream(ChunkedResponse([line({"type": "ERROR", "object": status})]), "/x")  # type: ignore[arg-type]
    with pytest.raises(KubeError) as caught:
        list(stream.events())
    assert caught.value.gone
    assert "too old" in caught.value.message


@pytest.mark.parametrize(
    ("chunk", "words"),
    [(b"not json\n", "not JSON"), (b'{"type": "ADDED"}\n', "without an object")],
)
def test_malformed_events_are_errors(chunk: bytes, words: str) -> None:
    stream = WatchStream(ChunkedResponse([chunk]), "/x")  # type: ignore[arg-type]
    with pytest.raises(KubeError, match=words):
        list(stream.events())


def test_a_broken_connection_is_an_error_unless_we_closed_it() -> None:
    broken = urllib3.exceptions.ProtocolError("Response ended prematurely")
    stream = WatchStream(ChunkedResponse([], error=broken), "/x")  # type: ignore[arg-type]
    with pytest.raises(KubeError, match="broke") as caught:
        list(stream.events())
    assert caught.value.status == 0

    response = ChunkedResponse([], error=broken)
    closed = WatchStream(response, "/x")  # type: ignore[arg-type]
    closed.close()
    assert list(closed.events()) == []
    assert response.closed and response.released


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            b'{"kind": "Status", "message": "secrets \\"x\\" is forbidden"}',
            '403 secrets "x" is forbidden',
        ),
        (b"plain text", "403 plain text"),
        (None, "403 Forbidden"),
    ],
)
def test_server_messages_are_one_line(body: bytes | None, expected: str) -> None:
    assert _server_message(403, body, "Forbidden") == expected
