"""ingress-nginx's TCP services ConfigMap: parsing, validation (an entry refused
alone, with its reason), the routes it becomes and their status, and the
PROXY protocol reader and writers the proxy uses for them."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from waygate.cli import main
from waygate.proxy import proxyproto
from waygate.resolver.gateway.translate import Objects, translate
from waygate.resolver.ingress_nginx.config import IngressNginx
from waygate.resolver.ingress_nginx.tcpservices import INVALID, TcpService, parse, parse_entry
from waygate.resolver.model import (
    ADMITTED,
    RESOLVED_REFS,
    TCP_LISTENER,
    Endpoint,
    EndpointPort,
    Service,
    ServicePort,
)
from waygate.resolver.status import RouteStatusBook

SETTINGS = IngressNginx(tcp_services=("ingress-nginx", "tcp-services"))


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("9000", "default/example-go:8080", TcpService(9000, "default", "example-go", "8080")),
        (
            "5432",
            "db/postgres:pg:PROXY",
            TcpService(5432, "db", "postgres", "pg", proxy_from_client=True),
        ),
        (
            "6379",
            "db/redis:6379:PROXY:proxy",
            TcpService(6379, "db", "redis", "6379", True, True),
        ),
        ("1", "a/b:1", TcpService(1, "a", "b", "1")),
        ("65535", "a/b:65535", TcpService(65535, "a", "b", "65535")),
    ],
)
def test_entries_in_ingress_nginx_format_are_parsed(key: str, value: str, expected: TcpService):
    assert parse_entry(key, value) == expected


@pytest.mark.parametrize(
    "key,value,reason",
    [
        ("0", "a/b:80", "not a port number"),
        ("65536", "a/b:80", "not a port number"),
        ("http", "a/b:80", "not a port number"),
        ("90 00", "a/b:80", "not a port number"),
        ("9000", "a/b", "NAMESPACE/SERVICE:PORT"),
        ("9000", "b:80", "NAMESPACE/SERVICE"),
        ("9000", "A/b:80", "NAMESPACE/SERVICE"),
        ("9000", "a/b;rm:80", "NAMESPACE/SERVICE"),
        ("9000", "a/b:0", "neither a port number nor a port name"),
        ("9000", "a/b:Http", "neither a port number nor a port name"),
        ("9000", "a/b:80:PROXY:PROXY:PROXY", "NAMESPACE/SERVICE:PORT"),
        ("9000", "a/b:80:SSL", "only PROXY may follow"),
        ("9000", "a/b:80::PROXY", "only PROXY may follow"),
        ("9000", "tcp://a/b:80", "PROTOCOL:// prefix is not honoured"),
        ("9000", "a/b:80?foo=bar", r"\?options are not honoured"),
        ("9000", "a/b:80\nproxy_pass evil", "NAMESPACE/SERVICE|neither|only PROXY"),
    ],
)
def test_bad_entries_are_refused_with_the_reason(key: str, value: str, reason: str):
    with pytest.raises(ValueError, match=reason):
        parse_entry(key, value)


def test_a_bad_entry_is_refused_alone():
    served, refused = parse({"9000": "a/b:80", "9001": "nope", "x": "a/b:80", "9002": "a/c:81"})
    assert [s.port for s in served] == [9000, 9002]
    assert set(refused) == {"9001", "x"}


def configmap(data: dict[str, Any], name: str = "tcp-services") -> Objects:
    found = Objects(
        services={
            ("db", "pg"): Service("db", "pg", ports=(ServicePort("pg", 5432, "5432"),)),
        }
    )
    found.of("ConfigMap")[("ingress-nginx", name)] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"namespace": "ingress-nginx", "name": name},
        "data": data,
    }
    return found


def test_the_configmap_becomes_tcp_routes_and_refusals_not_admitted():
    routes = translate(
        configmap({"5432": "db/pg:5432:PROXY", "6000": "db/missing:80", "bad": "x"}),
        ingress_nginx=SETTINGS,
    ).routes
    by_port = {r.listener_port: r for r in routes}
    assert all(r.listener_protocol == TCP_LISTENER for r in routes)
    pg = by_port[5432]
    assert pg.proxy_protocol_from_client and not pg.proxy_protocol_to_backend
    # The service port as the proxy finds it on EndpointSlices: by its name.
    assert [(b.namespace, b.service, b.port) for b in pg.backends] == [("db", "pg", "pg")]
    assert pg.origin == "ConfigMap ingress-nginx/tcp-services"
    [refused] = [r for r in routes if r.ingress_refusal]
    assert refused.ingress_refusal is not None
    assert refused.ingress_refusal[0] == INVALID and "'bad'" in refused.ingress_refusal[1]

    book = RouteStatusBook()
    ready = Endpoint("db", "pg", "10.0.0.1", ports=(EndpointPort("pg", 5432),))
    statuses = book.update(
        {r.key: r for r in routes},
        lambda ns, name: (
            Service("db", "pg", ports=(ServicePort("pg", 5432, "5432"),))
            if (ns, name) == ("db", "pg")
            else None
        ),
        lambda ns, name: (ready,) if (ns, name) == ("db", "pg") else (),
        changed_routes=[r.key for r in routes],
        now=datetime.now(UTC),
    )
    # TCP services claim no host: two of one namespace are both admitted.
    assert statuses[pg.key].admitted and statuses[by_port[6000].key].admitted
    missing = statuses[by_port[6000].key].condition(RESOLVED_REFS)
    assert missing is not None and missing.reason == "ServiceNotFound"
    admitted = statuses[refused.key].condition(ADMITTED)
    assert admitted is not None and admitted.reason == INVALID


def test_no_configmap_or_no_flag_no_tcp_routes():
    assert (
        translate(configmap({"5432": "db/pg:5432"}, name="other"), ingress_nginx=SETTINGS).routes
        == []
    )
    assert translate(configmap({"5432": "db/pg:5432"}), ingress_nginx=IngressNginx()).routes == []


# ---------------------------------------------------------------- PROXY protocol


ADDRESSES = [
    proxyproto.Addresses("192.0.2.1", 56324, "198.51.100.2", 443),
    proxyproto.Addresses("2001:db8::1", 1, "2001:db8::2", 65535),
]


@pytest.mark.parametrize("addresses", ADDRESSES)
@pytest.mark.parametrize("write", [proxyproto.v1, proxyproto.v2])
def test_headers_read_back_whole_and_split(addresses: proxyproto.Addresses, write: Any):
    data = write(addresses) + b"rest"
    header = proxyproto.read(data)
    assert header == proxyproto.Header(proxyproto.OK, len(data) - 4, addresses)
    for cut in range(1, len(data) - 4):
        assert proxyproto.read(data[:cut]).status == proxyproto.NEED_MORE


def test_the_specification_examples():
    assert proxyproto.v1(ADDRESSES[0]) == b"PROXY TCP4 192.0.2.1 198.51.100.2 56324 443\r\n"
    unknown = proxyproto.read(b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\nx")
    assert unknown.status == proxyproto.OK and unknown.addresses is None and unknown.length == 35
    local = proxyproto.V2_SIGNATURE + bytes((0x20, 0x00, 0, 0))
    assert proxyproto.read(local) == proxyproto.Header(proxyproto.OK, 16, None)


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\n",
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 3\r\n",
        b"PROXY TCP4 1.2.3.4 ::1 1 2\r\n",
        b"PROXY TCP4 1.2.3.4 5.6.7.8 01 2\r\n",
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1 65536\r\n",
        b"PROXY TCP4 999.2.3.4 5.6.7.8 1 2\r\n",
        b"PROXY TCP4 " + b"1" * 200,
        proxyproto.V2_SIGNATURE + bytes((0x11, 0x11, 0, 12)) + bytes(12),
        proxyproto.V2_SIGNATURE + bytes((0x2F, 0x11, 0, 12)) + bytes(12),
        proxyproto.V2_SIGNATURE + bytes((0x21, 0x11, 0xFF, 0xFF)),
        proxyproto.V2_SIGNATURE + bytes((0x21, 0x11, 0, 4)) + bytes(4),
        proxyproto.V2_SIGNATURE + bytes((0x21, 0x31, 0, 4)) + bytes(4),
        b"\r\n\r\nnot-quit",
    ],
)
def test_what_the_specification_does_not_allow_is_invalid(data: bytes):
    assert proxyproto.read(data).status == proxyproto.INVALID


# ---------------------------------------------------------------- the migration report


def test_the_migration_report_judges_tcp_entries_and_refuses_udp(tmp_path: Any, capsys: Any):
    tcp = {"9000": "default/db:5432", "9001": "default/db:5432:SSL"}
    udp = {"53": "kube-system/dns:53"}
    docs = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"namespace": "ingress-nginx", "name": n},
            "data": d,
        }
        for n, d in (("tcp-services", tcp), ("udp-services", udp))
    ]
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump_all(docs))
    code = main(
        [
            "ingress-nginx",
            "check",
            str(tmp_path),
            "--tcp-services-configmap",
            "ingress-nginx/tcp-services",
            "--udp-services-configmap",
            "ingress-nginx/udp-services",
            "-o",
            "json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    verdicts = {s["entry"]: (s["verdict"], s["note"]) for s in report["streamServices"]}
    assert verdicts["TCP 9000"][0] == "honoured"
    assert verdicts["TCP 9001"][0] == "not-honoured" and "only PROXY" in verdicts["TCP 9001"][1]
    assert verdicts["UDP 53"][0] == "not-honoured" and "no UDP" in verdicts["UDP 53"][1]
    # TCP entries alone, all good: exact.
    (tmp_path / "cm.yaml").write_text(
        yaml.safe_dump_all([{**docs[0], "data": {"9000": tcp["9000"]}}])
    )
    code = main(
        [
            "ingress-nginx",
            "check",
            str(tmp_path),
            "--tcp-services-configmap",
            "ingress-nginx/tcp-services",
        ]
    )
    assert code == 0, capsys.readouterr().out


def test_routes_lists_a_tcp_service_by_its_port():
    from waygate.resolver import convert
    from waygate.resolver.commands import format_routes

    [route] = translate(configmap({"5432": "db/pg:pg:PROXY"}), ingress_nginx=SETTINGS).routes
    text = format_routes([convert.route_to_proto(route)])
    [row] = [line for line in text.splitlines() if "tcp-services-tcp-5432" in line]
    assert "TCP :5432" in row
