"""What certs accepts in a CSR, checked before anything is signed (the issuing step's input).

No grpc, no state: pure functions of the CSR's bytes.

Invariants:
- a CSR is bounded before it costs anything: at most `max_sans` SANs, each
  DNS name at most 253 characters and each URI at most 2048, RSA keys of
  2048..4096 bits, ECDSA P-256/P-384 or Ed25519 and nothing else;
- a hostile DER CSR's SAN count is read from element headers only
  (`der_san_count`), before the full parse;
- a caller-supplied value appears in an error only through `excerpt`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import re
from collections.abc import Iterator

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from waygate.core.errors import InvalidArgument, excerpt

#: Most subject alternative names one CSR may ask for (setting max_sans_per_csr).
MAX_SANS = 100
#: RSA key sizes a CSR may carry: below is weak; above costs every peer's handshake and
#: certs' signature check for nothing (an 8192-bit key verifies ~4x slower than 4096).
MIN_RSA_BITS = 2048
MAX_RSA_BITS = 4096
#: Longest DNS name SAN (RFC 1035) and URI SAN (the SPIFFE ID maximum), in characters.
MAX_DNS_NAME_LENGTH = 253
MAX_URI_LENGTH = 2048

CertificatePublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey


@dataclasses.dataclass(frozen=True)
class Names:
    general_names: tuple[x509.GeneralName, ...]
    dns: tuple[str, ...]
    uris: tuple[str, ...]
    ips: tuple[str, ...]


def _san_extension(csr: x509.CertificateSigningRequest) -> x509.SubjectAlternativeName | None:
    try:
        return csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    except (ValueError, x509.DuplicateExtension) as exc:
        raise InvalidArgument(f"the CSR's extensions do not parse: {excerpt(str(exc))}") from None


def check_names(csr: x509.CertificateSigningRequest, max_sans: int = MAX_SANS) -> None:
    """The CSR asks for at most `max_sans` SANs, each within its length bound."""
    extension = _san_extension(csr)
    if extension is None:
        return
    count = len(extension)
    if count > max_sans:
        raise InvalidArgument(
            f"the CSR asks for {count} subject alternative names; at most {max_sans} "
            "are allowed per certificate (max_sans_per_csr)"
        )
    for name in extension:
        value = name.value
        if isinstance(name, x509.DNSName):
            kind, bound = "DNS name", MAX_DNS_NAME_LENGTH
        else:
            kind, bound = "name", MAX_URI_LENGTH
        text = value if isinstance(value, str) else str(value)
        if len(text) > bound:
            raise InvalidArgument(
                f"the CSR's {kind} {excerpt(text)} is longer than {bound} characters"
            )


def csr_names(csr: x509.CertificateSigningRequest, max_sans: int = MAX_SANS) -> Names:
    check_names(csr, max_sans)
    extension = _san_extension(csr)
    if extension is None:
        raise InvalidArgument("the CSR asks for no subject alternative names")
    general = tuple(extension)
    allowed_types = (x509.DNSName, x509.UniformResourceIdentifier, x509.IPAddress)
    for name in general:
        if not isinstance(name, allowed_types):
            raise InvalidArgument(f"the CSR asks for an unsupported name: {excerpt(str(name))}")
    if not general:
        raise InvalidArgument("the CSR asks for no subject alternative names")
    return Names(
        general_names=general,
        dns=tuple(n.value for n in general if isinstance(n, x509.DNSName)),
        uris=tuple(n.value for n in general if isinstance(n, x509.UniformResourceIdentifier)),
        ips=tuple(str(n.value) for n in general if isinstance(n, x509.IPAddress)),
    )


def load_csr(der: bytes, *, max_sans: int | None = None) -> x509.CertificateSigningRequest:
    """Parse a DER CSR (PEM accepted too); InvalidArgument when it is not one.

    With `max_sans`, a DER CSR asking for more SANs than that is refused before
    it is parsed: a hostile 60,000-SAN CSR then costs a few header reads rather
    than building 60,000 objects (`check_names` still checks the parsed CSR).
    """
    if not der:
        raise InvalidArgument("certificate_signing_request is empty")
    if der.lstrip().startswith(b"-----BEGIN"):
        # Decoded here so a PEM CSR gets the same cheap SAN count as DER does.
        der = _pem_csr_body(der)
    if max_sans is not None and (der_san_count(der, max_sans) or 0) > max_sans:
        raise InvalidArgument(
            f"the CSR asks for more than {max_sans} subject alternative names; at most "
            f"{max_sans} are allowed per certificate (max_sans_per_csr)"
        )
    try:
        return x509.load_der_x509_csr(der)
    except ValueError as exc:
        raise InvalidArgument(
            f"certificate_signing_request is not a PKCS#10 CSR: {excerpt(str(exc))}"
        ) from None


_PEM_CSR = re.compile(
    rb"-----BEGIN (?:NEW )?CERTIFICATE REQUEST-----(?P<body>[A-Za-z0-9+/=\s]*?)"
    rb"-----END (?:NEW )?CERTIFICATE REQUEST-----"
)


def _pem_csr_body(pem: bytes) -> bytes:
    """The DER inside a PEM CSR; InvalidArgument when it is not a PEM CSR."""
    found = _PEM_CSR.search(pem)
    if found is None:
        raise InvalidArgument(
            "certificate_signing_request is not a PKCS#10 CSR: PEM without a "
            "CERTIFICATE REQUEST block"
        )
    try:
        return base64.b64decode(b"".join(found.group("body").split()), validate=True)
    except binascii.Error as exc:
        raise InvalidArgument(
            f"certificate_signing_request is not a PKCS#10 CSR: bad PEM base64 ({exc})"
        ) from None


# DER of the extensionRequest attribute type (PKCS#9, 1.2.840.113549.1.9.14) and of the
# subjectAltName extension (2.5.29.17), each as an OBJECT IDENTIFIER element.
_EXTENSION_REQUEST_OID = bytes.fromhex("06092a864886f70d01090e")
_SAN_OID = bytes.fromhex("0603551d11")


def _element(der: bytes, at: int, end: int) -> tuple[int, int, int] | None:
    """(tag, value start, value end) of the DER element at `at`, or None if malformed."""
    if at + 2 > end or der[at] & 0x1F == 0x1F:
        return None
    tag, first = der[at], der[at + 1]
    at += 2
    if first < 0x80:
        length = first
    else:
        size = first & 0x7F
        if not 1 <= size <= 4 or at + size > end:
            return None
        length = int.from_bytes(der[at : at + size], "big")
        at += size
    if at + length > end:
        return None
    return tag, at, at + length


def _children(der: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    at = start
    while at < end:
        element = _element(der, at, end)
        if element is None:
            return
        yield element
        at = element[2]


def der_san_count(der: bytes, limit: int) -> int | None:
    """How many SANs a DER CSR asks for, counting no further than `limit + 1`; None
    when the CSR is not DER-shaped as expected (the full parse then decides).

    Reads only element headers: CertificationRequest > info > attributes [0] >
    extensionRequest > Extensions > subjectAltName > GeneralNames.
    """
    outer = _element(der, 0, len(der))
    if outer is None or outer[0] != 0x30:
        return None
    info = next(_children(der, outer[1], outer[2]), None)
    if info is None or info[0] != 0x30:
        return None
    counted: int | None = None
    for attributes in _children(der, info[1], info[2]):
        if attributes[0] != 0xA0:
            continue
        for attribute in _children(der, attributes[1], attributes[2]):
            parts = list(itertools.islice(_children(der, attribute[1], attribute[2]), 2))
            if len(parts) != 2 or der[parts[0][1] - 2 : parts[0][2]] != _EXTENSION_REQUEST_OID:
                continue
            extensions = next(_children(der, parts[1][1], parts[1][2]), None)
            if extensions is None:
                continue
            for extension in _children(der, extensions[1], extensions[2]):
                fields = list(_children(der, extension[1], extension[2]))
                if not fields or der[fields[0][1] - 2 : fields[0][2]] != _SAN_OID:
                    continue
                value = fields[-1]
                names = _element(der, value[1], value[2]) if value[0] == 0x04 else None
                if names is None:
                    continue
                count = sum(
                    1 for _ in itertools.islice(_children(der, names[1], names[2]), limit + 1)
                )
                counted = max(counted or 0, count)
    return counted


SUPPORTED_KEYS = f"ECDSA P-256/P-384, RSA {MIN_RSA_BITS}..{MAX_RSA_BITS} bits, Ed25519"


def check_csr(
    csr: x509.CertificateSigningRequest, *, max_sans: int = MAX_SANS
) -> CertificatePublicKey:
    """The CSR's key is one Waygate signs, its SANs are within bounds (`check_names`)
    and its self-signature verifies; returns the key."""
    key = csr_public_key(csr)
    verify_csr(csr, max_sans=max_sans)
    return key


def csr_public_key(csr: x509.CertificateSigningRequest) -> CertificatePublicKey:
    """The CSR's key, if it is one Waygate signs (the first half of `check_csr`)."""
    try:
        key = csr.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise InvalidArgument(
            f"the CSR's public key is not supported ({SUPPORTED_KEYS}): {excerpt(str(exc))}"
        ) from None
    if isinstance(key, rsa.RSAPublicKey):
        if not MIN_RSA_BITS <= key.key_size <= MAX_RSA_BITS:
            raise InvalidArgument(
                f"the CSR's RSA key has {key.key_size} bits; RSA keys must have "
                f"{MIN_RSA_BITS} to {MAX_RSA_BITS} bits"
            )
    elif isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, ec.SECP256R1 | ec.SECP384R1):
            raise InvalidArgument(
                f"the CSR's curve {key.curve.name} is not supported ({SUPPORTED_KEYS})"
            )
    elif not isinstance(key, ed25519.Ed25519PublicKey):
        raise InvalidArgument(
            f"the CSR's key type {type(key).__name__.lstrip('_')} is not supported "
            f"({SUPPORTED_KEYS})"
        )
    return key


def verify_csr(csr: x509.CertificateSigningRequest, *, max_sans: int = MAX_SANS) -> None:
    """The CSR's SANs are within bounds and its self-signature verifies (the second
    half of `check_csr`, after `csr_public_key`)."""
    check_names(csr, max_sans)
    try:
        valid = csr.is_signature_valid
    except (InvalidSignature, ValueError, UnsupportedAlgorithm):
        valid = False
    if not valid:
        raise InvalidArgument("the CSR's signature does not verify with its own public key")


#: The extended key usages a CSR may ask for; a leaf gets exactly those it asks for.
REQUESTABLE_USAGES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
}


def requested_usages(csr: x509.CertificateSigningRequest) -> tuple[x509.ObjectIdentifier, ...]:
    """The extended key usages the CSR asks for (its ExtendedKeyUsage extension request),
    in a fixed order; () when it asks for none (the leaf then gets both usages).

    This is how a caller asks for a narrower role: a tunnel agent asks for clientAuth
    only, and the tunnel server registers as an agent only a certificate that cannot
    serve TLS (see `waygate.tunnel.peers`). Anything but serverAuth and clientAuth
    is INVALID_ARGUMENT: Waygate issues no other usage.
    """
    try:
        extension = csr.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except x509.ExtensionNotFound:
        return ()
    except (ValueError, x509.DuplicateExtension) as exc:
        raise InvalidArgument(f"the CSR's extensions do not parse: {excerpt(str(exc))}") from None
    asked = set(extension.value)
    unknown = asked - REQUESTABLE_USAGES.keys()
    if unknown or not asked:
        shown = ", ".join(sorted(getattr(o, "_name", o.dotted_string) for o in unknown))
        raise InvalidArgument(
            "the CSR asks for extended key usages Waygate does not issue "
            f"({shown or 'an empty list'}); ask for serverAuth and/or clientAuth, or none "
            "for both"
        )
    return tuple(oid for oid in REQUESTABLE_USAGES if oid in asked)


def quick_to_verify(key: CertificatePublicKey) -> bool:
    """Whether checking a CSR with this key costs little enough (P-256, Ed25519, RSA:
    0.1 to 0.3 ms here) to run on the event loop; P-384 costs about 1 ms."""
    return not isinstance(key, ec.EllipticCurvePublicKey) or isinstance(key.curve, ec.SECP256R1)
