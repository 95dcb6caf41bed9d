from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ForwardBatch(_message.Message):
    __slots__ = ("seq", "packed")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    packed: bytes
    def __init__(self, seq: _Optional[int] = ..., packed: _Optional[bytes] = ...) -> None: ...

class ForwardResult(_message.Message):
    __slots__ = ("seq", "accepted", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    accepted: _containers.RepeatedScalarFieldContainer[bool]
    error: str
    def __init__(self, seq: _Optional[int] = ..., accepted: _Optional[_Iterable[bool]] = ..., error: _Optional[str] = ...) -> None: ...

class QueueRef(_message.Message):
    __slots__ = ("vhost", "queue")
    VHOST_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    vhost: str
    queue: str
    def __init__(self, vhost: _Optional[str] = ..., queue: _Optional[str] = ...) -> None: ...

class SessionControl(_message.Message):
    __slots__ = ("kind", "sub", "vhost", "queue", "window", "ids", "no_ack", "arguments")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[SessionControl.Kind]
        SUBSCRIBE: _ClassVar[SessionControl.Kind]
        WINDOW: _ClassVar[SessionControl.Kind]
        ACK: _ClassVar[SessionControl.Kind]
        REQUEUE: _ClassVar[SessionControl.Kind]
        REJECT: _ClassVar[SessionControl.Kind]
        UNSUBSCRIBE: _ClassVar[SessionControl.Kind]
        GET: _ClassVar[SessionControl.Kind]
    KIND_UNSPECIFIED: SessionControl.Kind
    SUBSCRIBE: SessionControl.Kind
    WINDOW: SessionControl.Kind
    ACK: SessionControl.Kind
    REQUEUE: SessionControl.Kind
    REJECT: SessionControl.Kind
    UNSUBSCRIBE: SessionControl.Kind
    GET: SessionControl.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SUB_FIELD_NUMBER: _ClassVar[int]
    VHOST_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    NO_ACK_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    kind: SessionControl.Kind
    sub: int
    vhost: str
    queue: str
    window: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    no_ack: bool
    arguments: bytes
    def __init__(self, kind: _Optional[_Union[SessionControl.Kind, str]] = ..., sub: _Optional[int] = ..., vhost: _Optional[str] = ..., queue: _Optional[str] = ..., window: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., no_ack: _Optional[bool] = ..., arguments: _Optional[bytes] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("kind", "sub", "reason", "code", "remaining", "packed")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[SessionEvent.Kind]
        DELIVERIES: _ClassVar[SessionEvent.Kind]
        CANCELLED: _ClassVar[SessionEvent.Kind]
        GET_OK: _ClassVar[SessionEvent.Kind]
        GET_EMPTY: _ClassVar[SessionEvent.Kind]
        ERROR: _ClassVar[SessionEvent.Kind]
    KIND_UNSPECIFIED: SessionEvent.Kind
    DELIVERIES: SessionEvent.Kind
    CANCELLED: SessionEvent.Kind
    GET_OK: SessionEvent.Kind
    GET_EMPTY: SessionEvent.Kind
    ERROR: SessionEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SUB_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    kind: SessionEvent.Kind
    sub: int
    reason: str
    code: int
    remaining: int
    packed: bytes
    def __init__(self, kind: _Optional[_Union[SessionEvent.Kind, str]] = ..., sub: _Optional[int] = ..., reason: _Optional[str] = ..., code: _Optional[int] = ..., remaining: _Optional[int] = ..., packed: _Optional[bytes] = ...) -> None: ...

class PurgeResult(_message.Message):
    __slots__ = ("purged",)
    PURGED_FIELD_NUMBER: _ClassVar[int]
    purged: int
    def __init__(self, purged: _Optional[int] = ...) -> None: ...

class GroupOffset(_message.Message):
    __slots__ = ("vhost", "queue", "group", "offset")
    VHOST_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    vhost: str
    queue: str
    group: str
    offset: int
    def __init__(self, vhost: _Optional[str] = ..., queue: _Optional[str] = ..., group: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CommitResult(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueStats(_message.Message):
    __slots__ = ("messages", "consumers", "first_offset", "next_offset", "bytes", "committed")
    class CommittedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    messages: int
    consumers: int
    first_offset: int
    next_offset: int
    bytes: int
    committed: _containers.ScalarMap[str, int]
    def __init__(self, messages: _Optional[int] = ..., consumers: _Optional[int] = ..., first_offset: _Optional[int] = ..., next_offset: _Optional[int] = ..., bytes: _Optional[int] = ..., committed: _Optional[_Mapping[str, int]] = ...) -> None: ...
