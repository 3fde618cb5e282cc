"""The sans-IO ClientHello reader, on ClientHellos made by OpenSSL itself."""

from __future__ import annotations

import ssl

import pytest

from waygate.proxy import sni


def client_hello(server_name: str | None) -> bytes:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def reframed(hello: bytes, size: int) -> bytes:
    """The same handshake message carried by several records of `size` bytes."""
    body = hello[5:]
    return b"".join(
        b"\x16\x03\x01" + len(body[i : i + size]).to_bytes(2, "big") + body[i : i + size]
        for i in range(0, len(body), size)
    )


def test_the_server_name_of_a_real_client_hello() -> None:
    assert sni.read_server_name(client_hello("Web.Example.COM")) == (sni.FOUND, "web.example.com")


def test_no_sni_is_found_as_empty() -> None:
    assert sni.read_server_name(client_hello(None)) == (sni.FOUND, "")


@pytest.mark.parametrize("record_size", [1, 7, 64, 500])
def test_a_client_hello_across_records_and_reads(record_size: int) -> None:
    data = reframed(client_hello("a.example.test"), record_size)
    for cut in range(len(data)):
        assert sni.read_server_name(data[:cut]) == (sni.NEED_MORE, ""), cut
    assert sni.read_server_name(data) == (sni.FOUND, "a.example.test")


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x17\x03\x03\x00\x10" + b"\x00" * 16,  # application data, not a handshake
        b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00",  # a ServerHello
        b"\x16\x03\x01\x00\x00",  # an empty record
    ],
)
def test_what_is_not_a_client_hello(data: bytes) -> None:
    assert sni.read_server_name(data)[0] == sni.NOT_TLS


def test_a_client_hello_over_the_bound() -> None:
    huge = (sni.MAX_HELLO + 1).to_bytes(3, "big")
    assert sni.read_server_name(b"\x16\x03\x01\x00\x04\x01" + huge)[0] == sni.TOO_LARGE


def test_a_truncated_extension_is_refused_not_crashed() -> None:
    hello = client_hello("a.example.test")
    body = bytearray(hello[5:])
    # Claim a longer ClientHello than there is, and make the record agree: the
    # extensions then overrun, which must read as NOT_TLS.
    index = body.find(b"a.example.test")
    body[index - 2 : index] = (200).to_bytes(2, "big")  # the host name's length
    data = b"\x16\x03\x01" + len(body).to_bytes(2, "big") + bytes(body)
    assert sni.read_server_name(data)[0] in (sni.NOT_TLS, sni.FOUND)
    assert sni.read_server_name(data) != (sni.FOUND, "a.example.test")
