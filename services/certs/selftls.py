"""certs' own serving certificate, through the same rotation client as every process.

The certs listener cannot take its certificate from certs over the network (it
is certs), so `AuthorityIssuer` answers the rotation client's CSRs from the
in-process `Authority`. Everything else is what every other Waygate process
gets from `waygate.core.rotation` and `waygate.core.grpctls`: a key made in memory
and never written anywhere, renewal at ~70% of the lifetime with jitter,
backoff, `waygate_certificate_expiry_timestamp_seconds` and the warning under
20% of life, and gRPC dynamic credentials that serve a renewed certificate from
the next handshake on without touching open connections.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from cryptography.hazmat.primitives import serialization

from waygate.certs.authority import Authority
from waygate.certs.csr import load_csr
from waygate.certs.issuing import leaf_request
from waygate.core.grpctls import dynamic_server_credentials
from waygate.core.rotation import CertificateRotator, Issued

_DER = serialization.Encoding.DER


class AuthorityIssuer:
    """The rotation client's Issuer, answered by certs' own CA in-process."""

    def __init__(self, authority: Authority) -> None:
        self.authority = authority

    async def certify(self, csr_der: bytes, identity: str) -> Issued:
        request = leaf_request(
            load_csr(csr_der), self.authority.config, identity=identity, requested_by="certs"
        )
        # On the loop only when that waits for nothing (see Authority.issue_at_once).
        issued = self.authority.issue_at_once(request)
        if issued is None:
            issued = await asyncio.to_thread(self.authority.issue, request)
        return Issued(
            issued.leaf.public_bytes(_DER),
            [c.public_bytes(_DER) for c in issued.chain],
            issued.valid_until,
        )


async def serving_certificate(
    authority: Authority, identity: str, sans: Sequence[str], **rotator_options: Any
) -> tuple[CertificateRotator, grpc.ServerCredentials]:
    """The first certificate for certs' listener, and credentials that follow its renewals.

    The caller runs `rotator.run()` for the life of the process. Server TLS only:
    Certify callers authenticate with a token, since they have no certificate yet.
    """
    rotator = CertificateRotator(AuthorityIssuer(authority), identity, sans, **rotator_options)
    await rotator.obtain()
    return rotator, dynamic_server_credentials(rotator, None, client_auth=False)
