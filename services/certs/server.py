"""The gRPC boundary of waygate.certs.v1.Certs: proto <-> domain, nothing else.

Domain errors raised by `CertsService` become status codes in the shared
boundary interceptor (`waygate.core.grpcserver`). Admin calls (RotateCA,
ListIssued) carry their token in the `authorization` metadata as
`Bearer <token>`; Certify carries it in the request, as the proto says.
ListIssued covers this replica's life (records are kept in memory, bounded)
and is paged: `next_page_token` leads to the next page, `replica` names the
process whose records these are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import grpc
from cryptography.hazmat.primitives import serialization
from google.protobuf import duration_pb2, timestamp_pb2

from waygate.certs.bundle import TrustBundleView
from waygate.certs.castate import CAView
from waygate.certs.consumers import REPORT_INTERVAL
from waygate.certs.issuing import IssuedRecord
from waygate.certs.rotation import ConsumerReport, Phase, RotationStatus
from waygate.certs.service import CertsService
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc
from waygate.core.errors import InvalidArgument
from waygate.core.grpcserver import ServiceRegistration

SERVICE_NAME = "waygate.certs.v1.Certs"
_DER = serialization.Encoding.DER


def _timestamp(moment: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def _authority(view: CAView) -> certs_pb2.CertificateAuthority:
    return certs_pb2.CertificateAuthority(
        certificate=view.certificate.public_bytes(_DER),
        state=f"CA_STATE_{view.state.value}",
        fingerprint_sha256=view.fingerprint,
        not_after=_timestamp(view.not_after),
    )


def bundle_message(bundle: TrustBundleView) -> certs_pb2.TrustBundle:
    return certs_pb2.TrustBundle(
        version=bundle.version,
        authorities=[_authority(a) for a in bundle.authorities],
        pem=bundle.pem,
    )


def _issued(record: IssuedRecord) -> certs_pb2.IssuedCertificate:
    return certs_pb2.IssuedCertificate(
        serial=record.serial,
        identity=record.identity,
        dns_names=list(record.dns_names),
        uris=list(record.uris),
        not_before=_timestamp(record.not_before),
        not_after=_timestamp(record.not_after),
        issuer_fingerprint_sha256=record.issuer_fingerprint,
        requested_by=record.requested_by,
    )


def consumer_message(report: ConsumerReport, *, live: bool) -> certs_pb2.TrustConsumer:
    return certs_pb2.TrustConsumer(
        identity=report.identity,
        instance=report.instance,
        bundle_version=report.version,
        fingerprints_sha256=sorted(report.fingerprints),
        last_report=_timestamp(report.reported_at),
        live=live,
    )


def rotation_message(status: RotationStatus, replica: str) -> certs_pb2.RotationStatus:
    live = set(map(id, status.live))
    message = certs_pb2.RotationStatus(
        phase=f"ROTATION_PHASE_{status.phase.name}",
        next_step=status.gate.step,
        waiting_for=[consumer_message(c, live=True) for c in status.gate.waiting_for],
        consumers=[consumer_message(c, live=id(c) in live) for c in status.consumers],
        replica=replica,
    )
    if status.gate.not_before is not None:
        message.not_before.CopyFrom(_timestamp(status.gate.not_before))
    if status.gate.settle_until is not None:
        message.settle_until.CopyFrom(_timestamp(status.gate.settle_until))
    return message


#: Longer than any duration a caller can mean; beyond it datetime arithmetic overflows.
MAX_DURATION = timedelta(days=100 * 365)


def _duration(message: Any, field: str) -> timedelta | None:
    """An optional Duration field as a timedelta; out-of-range values are INVALID_ARGUMENT."""
    if not message.HasField(field):
        return None
    value = getattr(message, field)
    if not 0 <= value.seconds <= MAX_DURATION.total_seconds():
        raise InvalidArgument(f"{field} must be between 0 and 100 years, not {value.seconds}s")
    return value.ToTimedelta()


def bearer_token(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return ""


class CertsServicer(certs_pb2_grpc.CertsServicer):
    def __init__(self, service: CertsService) -> None:
        self.service = service

    async def Certify(
        self, request: certs_pb2.CertifyRequest, context: grpc.aio.ServicerContext
    ) -> certs_pb2.CertifyResponse:
        issued = await self.service.certify(
            token=request.token,
            identity=request.identity,
            csr_der=request.certificate_signing_request,
            lifetime=_duration(request, "lifetime"),
        )
        return certs_pb2.CertifyResponse(
            leaf_certificate=issued.leaf.public_bytes(_DER),
            intermediate_certificates=[c.public_bytes(_DER) for c in issued.chain],
            valid_until=_timestamp(issued.valid_until),
            serial=issued.serial,
        )

    async def GetTrustBundle(
        self, request: certs_pb2.GetTrustBundleRequest, context: grpc.aio.ServicerContext
    ) -> certs_pb2.TrustBundle:
        return bundle_message(self.service.trust_bundle())

    async def WatchTrustBundle(
        self, request: certs_pb2.WatchTrustBundleRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[certs_pb2.TrustBundle]:
        bundle = self.service.trust_bundle()
        yield bundle_message(bundle)
        while True:
            bundle = await self.service.wait_for_change(bundle.version)
            yield bundle_message(bundle)

    async def RotateCA(
        self, request: certs_pb2.RotateCARequest, context: grpc.aio.ServicerContext
    ) -> certs_pb2.RotateCAResponse:
        if request.force:
            status = await self.service.rotation_status(token=bearer_token(context))
            if status.phase is not Phase.IDLE:
                step, overridden = await self.service.force_step(token=bearer_token(context))
                bundle = self.service.trust_bundle()
                active = next(a for a in bundle.authorities if a.state.value == "ACTIVE")
                return certs_pb2.RotateCAResponse(
                    new_authority=_authority(active),
                    bundle=bundle_message(bundle),
                    forced_step=step,
                    forced_past=[consumer_message(c, live=True) for c in overridden],
                )
        rotation = await self.service.rotate(
            token=bearer_token(context),
            propagation_delay=_duration(request, "propagation_delay"),
            ca_lifetime=_duration(request, "ca_lifetime"),
        )
        return certs_pb2.RotateCAResponse(
            new_authority=_authority(rotation.new_authority),
            signing_switch_at=_timestamp(rotation.signing_switch_at),
            old_retire_after=_timestamp(rotation.old_retire_after),
            bundle=bundle_message(rotation.bundle),
        )

    async def ReportTrust(
        self, request: certs_pb2.ReportTrustRequest, context: grpc.aio.ServicerContext
    ) -> certs_pb2.ReportTrustResponse:
        await self.service.report_trust(
            token=bearer_token(context),
            identity=request.identity,
            instance=request.instance,
            version=request.bundle_version,
            fingerprints=list(request.fingerprints_sha256),
            leaving=request.leaving,
        )
        return certs_pb2.ReportTrustResponse(
            report_interval=duration_pb2.Duration(seconds=int(REPORT_INTERVAL))
        )

    async def GetRotationStatus(
        self, request: certs_pb2.GetRotationStatusRequest, context: grpc.aio.ServicerContext
    ) -> certs_pb2.RotationStatus:
        status = await self.service.rotation_status(token=bearer_token(context))
        return rotation_message(status, self.service.replica)

    async def ListIssued(
        self, request: certs_pb2.ListIssuedRequest, context: grpc.aio.ServicerContext
    ) -> certs_pb2.ListIssuedResponse:
        listing = await self.service.list_issued(
            token=bearer_token(context),
            identity=request.identity,
            include_expired=request.include_expired,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return certs_pb2.ListIssuedResponse(
            certificates=[_issued(r) for r in listing.records],
            next_page_token=listing.next_page_token,
            replica=listing.replica,
        )


def registration(service: CertsService) -> ServiceRegistration:
    return ServiceRegistration(
        SERVICE_NAME, certs_pb2_grpc.add_CertsServicer_to_server, CertsServicer(service)
    )
