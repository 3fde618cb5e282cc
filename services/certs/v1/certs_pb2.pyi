import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CAState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CA_STATE_UNSPECIFIED: _ClassVar[CAState]
    CA_STATE_STAGED: _ClassVar[CAState]
    CA_STATE_ACTIVE: _ClassVar[CAState]
    CA_STATE_RETIRING: _ClassVar[CAState]

class RotationPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROTATION_PHASE_UNSPECIFIED: _ClassVar[RotationPhase]
    ROTATION_PHASE_IDLE: _ClassVar[RotationPhase]
    ROTATION_PHASE_PREPARE: _ClassVar[RotationPhase]
    ROTATION_PHASE_ACTIVATE: _ClassVar[RotationPhase]
    ROTATION_PHASE_RETIRE: _ClassVar[RotationPhase]
CA_STATE_UNSPECIFIED: CAState
CA_STATE_STAGED: CAState
CA_STATE_ACTIVE: CAState
CA_STATE_RETIRING: CAState
ROTATION_PHASE_UNSPECIFIED: RotationPhase
ROTATION_PHASE_IDLE: RotationPhase
ROTATION_PHASE_PREPARE: RotationPhase
ROTATION_PHASE_ACTIVATE: RotationPhase
ROTATION_PHASE_RETIRE: RotationPhase

class CertifyRequest(_message.Message):
    __slots__ = ("identity", "token", "certificate_signing_request", "lifetime")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_SIGNING_REQUEST_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_FIELD_NUMBER: _ClassVar[int]
    identity: str
    token: str
    certificate_signing_request: bytes
    lifetime: _duration_pb2.Duration
    def __init__(self, identity: _Optional[str] = ..., token: _Optional[str] = ..., certificate_signing_request: _Optional[bytes] = ..., lifetime: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CertifyResponse(_message.Message):
    __slots__ = ("leaf_certificate", "intermediate_certificates", "valid_until", "serial")
    LEAF_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    VALID_UNTIL_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    leaf_certificate: bytes
    intermediate_certificates: _containers.RepeatedScalarFieldContainer[bytes]
    valid_until: _timestamp_pb2.Timestamp
    serial: str
    def __init__(self, leaf_certificate: _Optional[bytes] = ..., intermediate_certificates: _Optional[_Iterable[bytes]] = ..., valid_until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., serial: _Optional[str] = ...) -> None: ...

class GetTrustBundleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchTrustBundleRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CertificateAuthority(_message.Message):
    __slots__ = ("certificate", "state", "fingerprint_sha256", "not_after")
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    certificate: bytes
    state: CAState
    fingerprint_sha256: str
    not_after: _timestamp_pb2.Timestamp
    def __init__(self, certificate: _Optional[bytes] = ..., state: _Optional[_Union[CAState, str]] = ..., fingerprint_sha256: _Optional[str] = ..., not_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TrustBundle(_message.Message):
    __slots__ = ("version", "authorities", "pem")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AUTHORITIES_FIELD_NUMBER: _ClassVar[int]
    PEM_FIELD_NUMBER: _ClassVar[int]
    version: int
    authorities: _containers.RepeatedCompositeFieldContainer[CertificateAuthority]
    pem: str
    def __init__(self, version: _Optional[int] = ..., authorities: _Optional[_Iterable[_Union[CertificateAuthority, _Mapping]]] = ..., pem: _Optional[str] = ...) -> None: ...

class RotateCARequest(_message.Message):
    __slots__ = ("propagation_delay", "ca_lifetime", "force")
    PROPAGATION_DELAY_FIELD_NUMBER: _ClassVar[int]
    CA_LIFETIME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    propagation_delay: _duration_pb2.Duration
    ca_lifetime: _duration_pb2.Duration
    force: bool
    def __init__(self, propagation_delay: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., ca_lifetime: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., force: _Optional[bool] = ...) -> None: ...

class RotateCAResponse(_message.Message):
    __slots__ = ("new_authority", "signing_switch_at", "old_retire_after", "bundle", "forced_step", "forced_past")
    NEW_AUTHORITY_FIELD_NUMBER: _ClassVar[int]
    SIGNING_SWITCH_AT_FIELD_NUMBER: _ClassVar[int]
    OLD_RETIRE_AFTER_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    FORCED_STEP_FIELD_NUMBER: _ClassVar[int]
    FORCED_PAST_FIELD_NUMBER: _ClassVar[int]
    new_authority: CertificateAuthority
    signing_switch_at: _timestamp_pb2.Timestamp
    old_retire_after: _timestamp_pb2.Timestamp
    bundle: TrustBundle
    forced_step: str
    forced_past: _containers.RepeatedCompositeFieldContainer[TrustConsumer]
    def __init__(self, new_authority: _Optional[_Union[CertificateAuthority, _Mapping]] = ..., signing_switch_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., old_retire_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., bundle: _Optional[_Union[TrustBundle, _Mapping]] = ..., forced_step: _Optional[str] = ..., forced_past: _Optional[_Iterable[_Union[TrustConsumer, _Mapping]]] = ...) -> None: ...

class ReportTrustRequest(_message.Message):
    __slots__ = ("identity", "instance", "bundle_version", "fingerprints_sha256", "leaving")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    identity: str
    instance: str
    bundle_version: int
    fingerprints_sha256: _containers.RepeatedScalarFieldContainer[str]
    leaving: bool
    def __init__(self, identity: _Optional[str] = ..., instance: _Optional[str] = ..., bundle_version: _Optional[int] = ..., fingerprints_sha256: _Optional[_Iterable[str]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class ReportTrustResponse(_message.Message):
    __slots__ = ("report_interval",)
    REPORT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    report_interval: _duration_pb2.Duration
    def __init__(self, report_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class TrustConsumer(_message.Message):
    __slots__ = ("identity", "instance", "bundle_version", "fingerprints_sha256", "last_report", "live")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    identity: str
    instance: str
    bundle_version: int
    fingerprints_sha256: _containers.RepeatedScalarFieldContainer[str]
    last_report: _timestamp_pb2.Timestamp
    live: bool
    def __init__(self, identity: _Optional[str] = ..., instance: _Optional[str] = ..., bundle_version: _Optional[int] = ..., fingerprints_sha256: _Optional[_Iterable[str]] = ..., last_report: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., live: _Optional[bool] = ...) -> None: ...

class GetRotationStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RotationStatus(_message.Message):
    __slots__ = ("phase", "next_step", "not_before", "waiting_for", "consumers", "replica", "settle_until")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SETTLE_UNTIL_FIELD_NUMBER: _ClassVar[int]
    phase: RotationPhase
    next_step: str
    not_before: _timestamp_pb2.Timestamp
    waiting_for: _containers.RepeatedCompositeFieldContainer[TrustConsumer]
    consumers: _containers.RepeatedCompositeFieldContainer[TrustConsumer]
    replica: str
    settle_until: _timestamp_pb2.Timestamp
    def __init__(self, phase: _Optional[_Union[RotationPhase, str]] = ..., next_step: _Optional[str] = ..., not_before: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., waiting_for: _Optional[_Iterable[_Union[TrustConsumer, _Mapping]]] = ..., consumers: _Optional[_Iterable[_Union[TrustConsumer, _Mapping]]] = ..., replica: _Optional[str] = ..., settle_until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListIssuedRequest(_message.Message):
    __slots__ = ("identity", "include_expired", "page_size", "page_token")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    identity: str
    include_expired: bool
    page_size: int
    page_token: str
    def __init__(self, identity: _Optional[str] = ..., include_expired: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class IssuedCertificate(_message.Message):
    __slots__ = ("serial", "identity", "dns_names", "uris", "not_before", "not_after", "issuer_fingerprint_sha256", "requested_by")
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    DNS_NAMES_FIELD_NUMBER: _ClassVar[int]
    URIS_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    ISSUER_FINGERPRINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BY_FIELD_NUMBER: _ClassVar[int]
    serial: str
    identity: str
    dns_names: _containers.RepeatedScalarFieldContainer[str]
    uris: _containers.RepeatedScalarFieldContainer[str]
    not_before: _timestamp_pb2.Timestamp
    not_after: _timestamp_pb2.Timestamp
    issuer_fingerprint_sha256: str
    requested_by: str
    def __init__(self, serial: _Optional[str] = ..., identity: _Optional[str] = ..., dns_names: _Optional[_Iterable[str]] = ..., uris: _Optional[_Iterable[str]] = ..., not_before: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., not_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., issuer_fingerprint_sha256: _Optional[str] = ..., requested_by: _Optional[str] = ...) -> None: ...

class ListIssuedResponse(_message.Message):
    __slots__ = ("certificates", "next_page_token", "replica")
    CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    certificates: _containers.RepeatedCompositeFieldContainer[IssuedCertificate]
    next_page_token: str
    replica: str
    def __init__(self, certificates: _Optional[_Iterable[_Union[IssuedCertificate, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., replica: _Optional[str] = ...) -> None: ...
