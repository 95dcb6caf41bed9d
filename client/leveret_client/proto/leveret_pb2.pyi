from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FilterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILTER_AUTO: _ClassVar[FilterKind]
    FILTER_EXACT: _ClassVar[FilterKind]
    FILTER_PREFIX: _ClassVar[FilterKind]
    FILTER_PATTERN: _ClassVar[FilterKind]
    FILTER_NONE: _ClassVar[FilterKind]

class OffsetSpec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OFFSET_UNSPECIFIED: _ClassVar[OffsetSpec]
    OFFSET_NEXT: _ClassVar[OffsetSpec]
    OFFSET_FIRST: _ClassVar[OffsetSpec]
    OFFSET_LAST: _ClassVar[OffsetSpec]
FILTER_AUTO: FilterKind
FILTER_EXACT: FilterKind
FILTER_PREFIX: FilterKind
FILTER_PATTERN: FilterKind
FILTER_NONE: FilterKind
OFFSET_UNSPECIFIED: OffsetSpec
OFFSET_NEXT: OffsetSpec
OFFSET_FIRST: OffsetSpec
OFFSET_LAST: OffsetSpec

class CreateQueueRequest(_message.Message):
    __slots__ = ("name", "durable", "exist_ok", "auto_delete", "max_length", "message_ttl_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    AUTO_DELETE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    durable: bool
    exist_ok: bool
    auto_delete: bool
    max_length: int
    message_ttl_ms: int
    def __init__(self, name: _Optional[str] = ..., durable: _Optional[bool] = ..., exist_ok: _Optional[bool] = ..., auto_delete: _Optional[bool] = ..., max_length: _Optional[int] = ..., message_ttl_ms: _Optional[int] = ...) -> None: ...

class QueueInfo(_message.Message):
    __slots__ = ("name", "durable", "messages", "consumers", "channels", "auto_delete", "exclusive")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    AUTO_DELETE_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    durable: bool
    messages: int
    consumers: int
    channels: int
    auto_delete: bool
    exclusive: bool
    def __init__(self, name: _Optional[str] = ..., durable: _Optional[bool] = ..., messages: _Optional[int] = ..., consumers: _Optional[int] = ..., channels: _Optional[int] = ..., auto_delete: _Optional[bool] = ..., exclusive: _Optional[bool] = ...) -> None: ...

class DeleteQueueRequest(_message.Message):
    __slots__ = ("name", "if_unused", "if_empty")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IF_UNUSED_FIELD_NUMBER: _ClassVar[int]
    IF_EMPTY_FIELD_NUMBER: _ClassVar[int]
    name: str
    if_unused: bool
    if_empty: bool
    def __init__(self, name: _Optional[str] = ..., if_unused: _Optional[bool] = ..., if_empty: _Optional[bool] = ...) -> None: ...

class DeleteQueueResponse(_message.Message):
    __slots__ = ("messages_dropped",)
    MESSAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    messages_dropped: int
    def __init__(self, messages_dropped: _Optional[int] = ...) -> None: ...

class ListQueuesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListQueuesResponse(_message.Message):
    __slots__ = ("queues",)
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[QueueInfo]
    def __init__(self, queues: _Optional[_Iterable[_Union[QueueInfo, _Mapping]]] = ...) -> None: ...

class CreateChannelRequest(_message.Message):
    __slots__ = ("queue", "topic", "kind", "name")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    queue: str
    topic: str
    kind: FilterKind
    name: str
    def __init__(self, queue: _Optional[str] = ..., topic: _Optional[str] = ..., kind: _Optional[_Union[FilterKind, str]] = ..., name: _Optional[str] = ...) -> None: ...

class ChannelInfo(_message.Message):
    __slots__ = ("id", "queue", "name", "topic", "kind", "ready", "unacked", "consumers")
    ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    UNACKED_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    queue: str
    name: str
    topic: str
    kind: FilterKind
    ready: int
    unacked: int
    consumers: int
    def __init__(self, id: _Optional[str] = ..., queue: _Optional[str] = ..., name: _Optional[str] = ..., topic: _Optional[str] = ..., kind: _Optional[_Union[FilterKind, str]] = ..., ready: _Optional[int] = ..., unacked: _Optional[int] = ..., consumers: _Optional[int] = ...) -> None: ...

class DeleteChannelRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteChannelResponse(_message.Message):
    __slots__ = ("messages_dropped",)
    MESSAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    messages_dropped: int
    def __init__(self, messages_dropped: _Optional[int] = ...) -> None: ...

class ListChannelsRequest(_message.Message):
    __slots__ = ("queue",)
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    queue: str
    def __init__(self, queue: _Optional[str] = ...) -> None: ...

class ListChannelsResponse(_message.Message):
    __slots__ = ("channels",)
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    channels: _containers.RepeatedCompositeFieldContainer[ChannelInfo]
    def __init__(self, channels: _Optional[_Iterable[_Union[ChannelInfo, _Mapping]]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("queue", "topic", "content", "properties", "persistent", "id")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    queue: str
    topic: str
    content: bytes
    properties: _containers.ScalarMap[str, str]
    persistent: bool
    id: str
    def __init__(self, queue: _Optional[str] = ..., topic: _Optional[str] = ..., content: _Optional[bytes] = ..., properties: _Optional[_Mapping[str, str]] = ..., persistent: _Optional[bool] = ..., id: _Optional[str] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("id", "offset")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    id: str
    offset: int
    def __init__(self, id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class PushBatchRequest(_message.Message):
    __slots__ = ("queue", "messages")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    queue: str
    messages: _containers.RepeatedCompositeFieldContainer[PushRequest]
    def __init__(self, queue: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[PushRequest, _Mapping]]] = ...) -> None: ...

class PushBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PushResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[PushResponse, _Mapping]]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("channel_id", "prefetch", "auto_ack", "max_batch")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    AUTO_ACK_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    prefetch: int
    auto_ack: bool
    max_batch: int
    def __init__(self, channel_id: _Optional[str] = ..., prefetch: _Optional[int] = ..., auto_ack: _Optional[bool] = ..., max_batch: _Optional[int] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("delivery_id", "id", "topic", "content", "properties", "offset", "timestamp_ms", "redelivered", "delivery_count")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    delivery_id: int
    id: str
    topic: str
    content: bytes
    properties: _containers.ScalarMap[str, str]
    offset: int
    timestamp_ms: int
    redelivered: bool
    delivery_count: int
    def __init__(self, delivery_id: _Optional[int] = ..., id: _Optional[str] = ..., topic: _Optional[str] = ..., content: _Optional[bytes] = ..., properties: _Optional[_Mapping[str, str]] = ..., offset: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., redelivered: _Optional[bool] = ..., delivery_count: _Optional[int] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Delivery]
    def __init__(self, messages: _Optional[_Iterable[_Union[Delivery, _Mapping]]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("delivery_ids",)
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, delivery_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("delivery_ids", "requeue")
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEUE_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    requeue: bool
    def __init__(self, delivery_ids: _Optional[_Iterable[int]] = ..., requeue: _Optional[bool] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("settled", "unknown")
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    settled: int
    unknown: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, settled: _Optional[int] = ..., unknown: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeEntry(_message.Message):
    __slots__ = ("id", "region", "grpc", "amqp", "queues", "draining")
    ID_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    AMQP_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    id: str
    region: str
    grpc: str
    amqp: str
    queues: int
    draining: bool
    def __init__(self, id: _Optional[str] = ..., region: _Optional[str] = ..., grpc: _Optional[str] = ..., amqp: _Optional[str] = ..., queues: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class NodesResponse(_message.Message):
    __slots__ = ("node", "region", "nodes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    node: str
    region: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeEntry]
    def __init__(self, node: _Optional[str] = ..., region: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeEntry, _Mapping]]] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("kind", "node", "vhost", "queue", "timestamp_ms")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ClusterEvent.Kind]
        NODE_UP: _ClassVar[ClusterEvent.Kind]
        QUEUE_CREATED: _ClassVar[ClusterEvent.Kind]
        QUEUE_DELETED: _ClassVar[ClusterEvent.Kind]
        NODE_ADDED: _ClassVar[ClusterEvent.Kind]
        NODE_LOST: _ClassVar[ClusterEvent.Kind]
        QUEUE_MOVED: _ClassVar[ClusterEvent.Kind]
    KIND_UNSPECIFIED: ClusterEvent.Kind
    NODE_UP: ClusterEvent.Kind
    QUEUE_CREATED: ClusterEvent.Kind
    QUEUE_DELETED: ClusterEvent.Kind
    NODE_ADDED: ClusterEvent.Kind
    NODE_LOST: ClusterEvent.Kind
    QUEUE_MOVED: ClusterEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    VHOST_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    kind: ClusterEvent.Kind
    node: str
    vhost: str
    queue: str
    timestamp_ms: int
    def __init__(self, kind: _Optional[_Union[ClusterEvent.Kind, str]] = ..., node: _Optional[str] = ..., vhost: _Optional[str] = ..., queue: _Optional[str] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class CreateStreamRequest(_message.Message):
    __slots__ = ("name", "partitions", "max_age", "max_bytes", "exist_ok")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_AGE_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    name: str
    partitions: int
    max_age: str
    max_bytes: int
    exist_ok: bool
    def __init__(self, name: _Optional[str] = ..., partitions: _Optional[int] = ..., max_age: _Optional[str] = ..., max_bytes: _Optional[int] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class PartitionInfo(_message.Message):
    __slots__ = ("stream", "first_offset", "next_offset", "messages", "bytes", "committed")
    class CommittedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STREAM_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    stream: str
    first_offset: int
    next_offset: int
    messages: int
    bytes: int
    committed: _containers.ScalarMap[str, int]
    def __init__(self, stream: _Optional[str] = ..., first_offset: _Optional[int] = ..., next_offset: _Optional[int] = ..., messages: _Optional[int] = ..., bytes: _Optional[int] = ..., committed: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StreamInfo(_message.Message):
    __slots__ = ("name", "partitioned", "partitions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTITIONED_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    partitioned: bool
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionInfo]
    def __init__(self, name: _Optional[str] = ..., partitioned: _Optional[bool] = ..., partitions: _Optional[_Iterable[_Union[PartitionInfo, _Mapping]]] = ...) -> None: ...

class GetStreamRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteStreamRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteStreamResponse(_message.Message):
    __slots__ = ("messages_dropped",)
    MESSAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    messages_dropped: int
    def __init__(self, messages_dropped: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("topic", "body", "key", "properties")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    topic: str
    body: bytes
    key: str
    properties: _containers.ScalarMap[str, str]
    def __init__(self, topic: _Optional[str] = ..., body: _Optional[bytes] = ..., key: _Optional[str] = ..., properties: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("id", "stream", "offset")
    ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    id: str
    stream: str
    offset: int
    def __init__(self, id: _Optional[str] = ..., stream: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class StreamSubscribeRequest(_message.Message):
    __slots__ = ("offsets", "group", "auto_commit", "prefetch", "max_batch", "from_timestamp_ms")
    class OffsetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    AUTO_COMMIT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    FROM_TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.ScalarMap[str, int]
    group: str
    auto_commit: bool
    prefetch: int
    max_batch: int
    from_timestamp_ms: int
    def __init__(self, offsets: _Optional[_Mapping[str, int]] = ..., group: _Optional[str] = ..., auto_commit: _Optional[bool] = ..., prefetch: _Optional[int] = ..., max_batch: _Optional[int] = ..., from_timestamp_ms: _Optional[int] = ...) -> None: ...

class StreamMessage(_message.Message):
    __slots__ = ("id", "timestamp_ms", "topic", "body", "stream", "offset", "key", "properties")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    id: str
    timestamp_ms: int
    topic: str
    body: bytes
    stream: str
    offset: int
    key: str
    properties: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., timestamp_ms: _Optional[int] = ..., topic: _Optional[str] = ..., body: _Optional[bytes] = ..., stream: _Optional[str] = ..., offset: _Optional[int] = ..., key: _Optional[str] = ..., properties: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StreamMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[StreamMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[StreamMessage, _Mapping]]] = ...) -> None: ...

class CommitOffsetRequest(_message.Message):
    __slots__ = ("group", "stream", "offset")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    group: str
    stream: str
    offset: int
    def __init__(self, group: _Optional[str] = ..., stream: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CommitOffsetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
