"""Property: no Certify input crashes certs or comes back INTERNAL (issue 8 item 8).

Hypothesis feeds CertsService.certify — the domain behind the gRPC Certify,
whose boundary maps each domain error to its status — with random bytes,
mutated and well-formed CSRs of every key type (supported or not), SAN lists
of every kind and size up to past the cap, identities of any text and
length, tokens, and lifetimes. Every outcome must be an issued leaf or a
domain error with a status other than INTERNAL and a bounded message; a
leaf, when issued, carries exactly the SANs asked for.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.unit.certs.helpers import duplicate_san_csr_der, open_authority
from waygate.certs.auth import Caller, StaticTokenAuthenticator
from waygate.certs.policy import Policy, ServiceInfo
from waygate.certs.service import CertsService, SigningExecutor
from waygate.core.errors import WaygateError

TOKEN = "p" * 40
SA_TOKEN = "q" * 40
TRUST_DOMAIN = "waygate.local"
STATIC = Caller(
    name="wild",
    allowed=("dns:*.hostile.test", f"uri:spiffe://{TRUST_DOMAIN}/*", "ip:127.0.0.1"),
)
WEB = Caller(name="system:serviceaccount:shop:web", namespace="shop", service_account="web")

# Keys are made once: generating RSA per example would be most of the run.
KEYS: list[object] = [
    ec.generate_private_key(ec.SECP256R1()),
    ec.generate_private_key(ec.SECP384R1()),
    ec.generate_private_key(ec.SECP521R1()),
    ec.generate_private_key(ec.SECP256K1()),
    ed25519.Ed25519PrivateKey.generate(),
    ed448.Ed448PrivateKey.generate(),
    rsa.generate_private_key(public_exponent=65537, key_size=1024),
    rsa.generate_private_key(public_exponent=65537, key_size=2048),
]


#: A correctly signed CSR holding the SAN extension twice (made once: its key is random).
DUPLICATE_SAN_CSR = duplicate_san_csr_der()


class Services:
    async def service(self, namespace: str, name: str) -> ServiceInfo | None:
        return ServiceInfo(namespace, name, "web" if name.startswith("w") else None)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CertsService]:
    authority = open_authority(Path(tmp_path_factory.mktemp("ca")) / "ca", max_sans=100)
    service = CertsService(
        StaticTokenAuthenticator([(TOKEN, STATIC), (SA_TOKEN, WEB)]),
        Policy(TRUST_DOMAIN, services=Services()),
        replica="test/1",
        executor=SigningExecutor(2, 64),
    )
    service.attach(authority)
    yield service
    service.close()


label = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-*_.", min_size=0, max_size=20)
dns_value = st.one_of(
    st.builds(lambda a: f"{a}.hostile.test", label),
    st.builds(lambda a: f"{a}.shop.svc", label),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=300),
)
uri_value = st.one_of(
    st.builds(lambda a: f"spiffe://{TRUST_DOMAIN}/ns/{a}", label),
    st.just(f"spiffe://{TRUST_DOMAIN}/ns/shop/sa/web"),
    st.builds(lambda n: f"spiffe://{TRUST_DOMAIN}/" + "x" * n, st.integers(0, 2200)),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=100),
)
general_name = st.one_of(
    st.builds(x509.DNSName, dns_value),
    st.builds(x509.UniformResourceIdentifier, uri_value),
    st.builds(
        x509.IPAddress,
        st.one_of(
            st.just(ipaddress.ip_address("127.0.0.1")),
            st.ip_addresses(),
        ),
    ),
    st.builds(x509.RFC822Name, st.just("someone@hostile.test")),
    st.builds(
        x509.DirectoryName,
        st.just(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "x")])),
    ),
)


@st.composite
def well_formed_csr(draw: st.DrawFn) -> bytes:
    key = draw(st.sampled_from(KEYS))
    names = draw(
        st.one_of(
            st.lists(general_name, min_size=0, max_size=8),
            st.lists(general_name, min_size=95, max_size=130),
        )
    )
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if names:
        try:
            extension = x509.SubjectAlternativeName(names)
        except ValueError:
            extension = x509.SubjectAlternativeName(names[:1])
        builder = builder.add_extension(extension, critical=draw(st.booleans()))
    edwards = isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey)
    # Deterministic signatures: the same draws must give the same bytes (hypothesis
    # replays examples, and a mutation's positions depend on the length).
    csr = builder.sign(
        key,  # type: ignore[arg-type]
        None if edwards else hashes.SHA256(),
        ecdsa_deterministic=True if isinstance(key, ec.EllipticCurvePrivateKey) else None,
    )
    encoding = draw(st.sampled_from([serialization.Encoding.DER, serialization.Encoding.PEM]))
    return csr.public_bytes(encoding)


@st.composite
def mutated(draw: st.DrawFn, inner: st.SearchStrategy[bytes]) -> bytes:
    der = bytearray(draw(inner))
    for _ in range(draw(st.integers(1, 4))):
        index = draw(st.integers(0, len(der) - 1))
        der[index] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        der = der[: draw(st.integers(0, len(der)))]
    return bytes(der)


csr_bytes = st.one_of(
    well_formed_csr(),
    mutated(well_formed_csr()),
    st.binary(max_size=512),
    st.just(b""),
    st.just(DUPLICATE_SAN_CSR),
)
identity = st.one_of(
    st.sampled_from(
        [
            f"spiffe://{TRUST_DOMAIN}/ns/shop/sa/web",
            f"spiffe://{TRUST_DOMAIN}/ns/a",
            "a.hostile.test",
            "web.shop.svc",
            "127.0.0.1",
            "",
        ]
    ),
    st.text(max_size=64),
    st.builds(lambda n: "i" * n, st.integers(2000, 5000)),
)
lifetime = st.one_of(
    st.none(),
    st.builds(lambda s: dt.timedelta(seconds=s), st.integers(-86400, 30 * 86400)),
)


@st.composite
def coherent_request(draw: st.DrawFn) -> tuple[bytes, str, str]:
    """A request a real caller might send (mostly allowed), so the issuing path and
    the policy's refusals are exercised, not only parsing."""
    small = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
    if draw(st.booleans()):
        token = TOKEN
        pool = st.one_of(
            st.builds(lambda a: f"dns:{a}.hostile.test", small),
            st.builds(lambda a: f"uri:spiffe://{TRUST_DOMAIN}/ns/{a}", small),
            st.just("ip:127.0.0.1"),
            st.just("dns:forbidden.example"),
        )
    else:
        token = SA_TOKEN
        pool = st.one_of(
            st.just(f"uri:spiffe://{TRUST_DOMAIN}/ns/shop/sa/web"),
            st.builds(lambda a: f"dns:{a}.shop.svc", small),
            st.builds(lambda a: f"dns:{a}.shop.svc.cluster.local", small),
            st.builds(lambda a: f"dns:{a}.other.svc", small),
        )
    names = draw(st.lists(pool, min_size=1, max_size=draw(st.sampled_from([4, 110]))))
    key = draw(st.sampled_from(KEYS))
    general = []
    for name in names:
        kind, _, value = name.partition(":")
        if kind == "dns":
            general.append(x509.DNSName(value))
        elif kind == "uri":
            general.append(x509.UniformResourceIdentifier(value))
        else:
            general.append(x509.IPAddress(ipaddress.ip_address(value)))
    edwards = isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName(general), critical=True)
        .sign(
            key,  # type: ignore[arg-type]
            None if edwards else hashes.SHA256(),
            ecdsa_deterministic=True if isinstance(key, ec.EllipticCurvePrivateKey) else None,
        )
    )
    identity = draw(
        st.one_of(st.sampled_from(names).map(lambda n: n.partition(":")[2]), st.text(max_size=20))
    )
    return csr.public_bytes(serialization.Encoding.DER), identity, token


random_request = st.tuples(
    csr_bytes,
    identity,
    st.one_of(st.sampled_from([TOKEN, SA_TOKEN]), st.text(max_size=50)),
)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=st.one_of(coherent_request(), random_request), lifetime=lifetime)
def test_certify_never_crashes_or_answers_internal(
    loop: asyncio.AbstractEventLoop,
    service: CertsService,
    request: tuple[bytes, str, str],
    lifetime: dt.timedelta | None,
) -> None:
    csr, identity, token = request
    call = service.certify(token=token, identity=identity, csr_der=csr, lifetime=lifetime)
    try:
        issued = loop.run_until_complete(call)
    except WaygateError as exc:
        event(exc.status)
        assert exc.status != "INTERNAL", str(exc)
        assert len(str(exc)) < 1500, f"unbounded message ({len(str(exc))} characters)"
        return
    event("issued")
    asked = x509.load_der_x509_csr(csr) if not csr.startswith(b"-----") else None
    sans = issued.leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert len(sans) <= 100
    if asked is not None:
        wanted = asked.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert list(sans) == list(wanted)
