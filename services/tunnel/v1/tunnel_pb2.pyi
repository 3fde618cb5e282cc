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

class PacketType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PACKET_TYPE_UNSPECIFIED: _ClassVar[PacketType]
    DIAL_REQ: _ClassVar[PacketType]
    DIAL_RSP: _ClassVar[PacketType]
    DATA: _ClassVar[PacketType]
    CLOSE_REQ: _ClassVar[PacketType]
    CLOSE_RSP: _ClassVar[PacketType]
    DRAIN: _ClassVar[PacketType]
    WINDOW_UPDATE: _ClassVar[PacketType]
    SERVER_INFO: _ClassVar[PacketType]

class RefusalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_REASON_UNSPECIFIED: _ClassVar[RefusalReason]
    NOT_ALLOWED: _ClassVar[RefusalReason]
    UNREACHABLE: _ClassVar[RefusalReason]
    NO_AGENT: _ClassVar[RefusalReason]
    TIMEOUT: _ClassVar[RefusalReason]
    DRAINING: _ClassVar[RefusalReason]
    INVALID: _ClassVar[RefusalReason]
PACKET_TYPE_UNSPECIFIED: PacketType
DIAL_REQ: PacketType
DIAL_RSP: PacketType
DATA: PacketType
CLOSE_REQ: PacketType
CLOSE_RSP: PacketType
DRAIN: PacketType
WINDOW_UPDATE: PacketType
SERVER_INFO: PacketType
REFUSAL_REASON_UNSPECIFIED: RefusalReason
NOT_ALLOWED: RefusalReason
UNREACHABLE: RefusalReason
NO_AGENT: RefusalReason
TIMEOUT: RefusalReason
DRAINING: RefusalReason
INVALID: RefusalReason

class Packet(_message.Message):
    __slots__ = ("type", "dial_request", "dial_response", "data", "close_request", "close_response", "drain", "window_update", "server_info")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DIAL_REQUEST_FIELD_NUMBER: _ClassVar[int]
    DIAL_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLOSE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLOSE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_UPDATE_FIELD_NUMBER: _ClassVar[int]
    SERVER_INFO_FIELD_NUMBER: _ClassVar[int]
    type: PacketType
    dial_request: DialRequest
    dial_response: DialResponse
    data: Data
    close_request: CloseRequest
    close_response: CloseResponse
    drain: Drain
    window_update: WindowUpdate
    server_info: ServerInfo
    def __init__(self, type: _Optional[_Union[PacketType, str]] = ..., dial_request: _Optional[_Union[DialRequest, _Mapping]] = ..., dial_response: _Optional[_Union[DialResponse, _Mapping]] = ..., data: _Optional[_Union[Data, _Mapping]] = ..., close_request: _Optional[_Union[CloseRequest, _Mapping]] = ..., close_response: _Optional[_Union[CloseResponse, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., window_update: _Optional[_Union[WindowUpdate, _Mapping]] = ..., server_info: _Optional[_Union[ServerInfo, _Mapping]] = ...) -> None: ...

class DialRequest(_message.Message):
    __slots__ = ("protocol", "address", "random", "timeout", "initial_window", "trace_context", "data_token", "splice_for")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANDOM_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    INITIAL_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPLICE_FOR_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    address: str
    random: int
    timeout: _duration_pb2.Duration
    initial_window: int
    trace_context: _containers.ScalarMap[str, str]
    data_token: str
    splice_for: str
    def __init__(self, protocol: _Optional[str] = ..., address: _Optional[str] = ..., random: _Optional[int] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., initial_window: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., data_token: _Optional[str] = ..., splice_for: _Optional[str] = ...) -> None: ...

class DialResponse(_message.Message):
    __slots__ = ("random", "connect_id", "error", "initial_window", "reason")
    RANDOM_FIELD_NUMBER: _ClassVar[int]
    CONNECT_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INITIAL_WINDOW_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    random: int
    connect_id: int
    error: str
    initial_window: int
    reason: RefusalReason
    def __init__(self, random: _Optional[int] = ..., connect_id: _Optional[int] = ..., error: _Optional[str] = ..., initial_window: _Optional[int] = ..., reason: _Optional[_Union[RefusalReason, str]] = ...) -> None: ...

class Data(_message.Message):
    __slots__ = ("connect_id", "data", "eof")
    CONNECT_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    connect_id: int
    data: bytes
    eof: bool
    def __init__(self, connect_id: _Optional[int] = ..., data: _Optional[bytes] = ..., eof: _Optional[bool] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("connect_id", "reason")
    CONNECT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    connect_id: int
    reason: str
    def __init__(self, connect_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("connect_id", "error")
    CONNECT_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    connect_id: int
    error: str
    def __init__(self, connect_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason", "grace")
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    grace: _duration_pb2.Duration
    def __init__(self, reason: _Optional[str] = ..., grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("server_id", "replica_ids", "data_address", "park_key")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PARK_KEY_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    data_address: str
    park_key: str
    def __init__(self, server_id: _Optional[str] = ..., replica_ids: _Optional[_Iterable[str]] = ..., data_address: _Optional[str] = ..., park_key: _Optional[str] = ...) -> None: ...

class WindowUpdate(_message.Message):
    __slots__ = ("connect_id", "increment")
    CONNECT_ID_FIELD_NUMBER: _ClassVar[int]
    INCREMENT_FIELD_NUMBER: _ClassVar[int]
    connect_id: int
    increment: int
    def __init__(self, connect_id: _Optional[int] = ..., increment: _Optional[int] = ...) -> None: ...

class DialTarget(_message.Message):
    __slots__ = ("node", "host", "port", "connect_timeout")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    CONNECT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    node: str
    host: str
    port: int
    connect_timeout: _duration_pb2.Duration
    def __init__(self, node: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., connect_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class DialAccepted(_message.Message):
    __slots__ = ("server_id", "agent_id", "connect_id")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECT_ID_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    agent_id: str
    connect_id: int
    def __init__(self, server_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., connect_id: _Optional[int] = ...) -> None: ...

class DialRefused(_message.Message):
    __slots__ = ("reason", "message", "server_id")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    reason: RefusalReason
    message: str
    server_id: str
    def __init__(self, reason: _Optional[_Union[RefusalReason, str]] = ..., message: _Optional[str] = ..., server_id: _Optional[str] = ...) -> None: ...

class DialFrame(_message.Message):
    __slots__ = ("target", "accepted", "data", "eof", "refused")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    target: DialTarget
    accepted: DialAccepted
    data: bytes
    eof: bool
    refused: DialRefused
    def __init__(self, target: _Optional[_Union[DialTarget, _Mapping]] = ..., accepted: _Optional[_Union[DialAccepted, _Mapping]] = ..., data: _Optional[bytes] = ..., eof: _Optional[bool] = ..., refused: _Optional[_Union[DialRefused, _Mapping]] = ...) -> None: ...

class ListAgentsRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class Agent(_message.Message):
    __slots__ = ("node", "agent_id", "remote_address", "connected_since", "open_connections", "draining")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_SINCE_FIELD_NUMBER: _ClassVar[int]
    OPEN_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_id: str
    remote_address: str
    connected_since: _timestamp_pb2.Timestamp
    open_connections: int
    draining: bool
    def __init__(self, node: _Optional[str] = ..., agent_id: _Optional[str] = ..., remote_address: _Optional[str] = ..., connected_since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., open_connections: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerDescription(_message.Message):
    __slots__ = ("server_id", "data_address")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    data_address: str
    def __init__(self, server_id: _Optional[str] = ..., data_address: _Optional[str] = ...) -> None: ...

class ListAgentsResponse(_message.Message):
    __slots__ = ("server_id", "agents")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    agents: _containers.RepeatedCompositeFieldContainer[Agent]
    def __init__(self, server_id: _Optional[str] = ..., agents: _Optional[_Iterable[_Union[Agent, _Mapping]]] = ...) -> None: ...
