"""Subject alternative names written as text: `dns:NAME`, `uri:URI`, `ip:ADDRESS`.

One reading of these names for both sides of a certificate request: the
rotation client that builds CSRs and certs, whose policy, CLI and own
serving certificate use the same forms. Malformed names are InvalidArgument.
"""

from __future__ import annotations

import ipaddress

from cryptography import x509

from waygate.core.errors import InvalidArgument


def parse_san(text: str) -> x509.GeneralName:
    """'dns:NAME', 'uri:URI' or 'ip:ADDRESS' -> a GeneralName."""
    kind, sep, value = text.partition(":")
    kind, value = kind.strip().lower(), value.strip()
    if not sep or not value:
        raise InvalidArgument(f"name {text!r} must be dns:NAME, uri:URI or ip:ADDRESS")
    if kind == "dns":
        return x509.DNSName(value)
    if kind == "uri":
        return x509.UniformResourceIdentifier(value)
    if kind == "ip":
        try:
            return x509.IPAddress(ipaddress.ip_address(value))
        except ValueError:
            raise InvalidArgument(f"name {text!r}: {value!r} is not an IP address") from None
    raise InvalidArgument(f"name {text!r}: kind must be dns, uri or ip, not {kind!r}")


def identity_san(identity: str) -> str:
    """The SAN an identity appears as: a URI (spiffe://...), an IP address, else a DNS name."""
    if "://" in identity:
        return f"uri:{identity}"
    try:
        return f"ip:{ipaddress.ip_address(identity)}"
    except ValueError:
        return f"dns:{identity}"
