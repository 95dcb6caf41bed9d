"""Python client of ``leveret.v1.Streams``: create streams, publish, subscribe from offsets, commit.

::

    with StreamsClient("127.0.0.1:50051") as c:
        c.create_stream("orders", partitions=4, max_age="7D", exist_ok=True)
        c.publish("orders", b"...", key="customer-42")       # -> (id, stream, offset)
        with c.subscribe({"orders": FIRST}, group="billing") as sub:
            for m in sub:                                   # m.stream, m.offset: where to resume
                ...
                c.commit("billing", m.stream, m.offset)

See docs/STREAMS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from leveret_client.client import _OPTIONS, LeveretError, _metadata, _Received, _StreamReader, _wrap
from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc

NEXT = pb.OFFSET_NEXT
FIRST = pb.OFFSET_FIRST
LAST = pb.OFFSET_LAST

__all__ = ["FIRST", "LAST", "NEXT", "StreamMessage", "StreamSubscriber", "StreamsClient"]


@dataclass
class StreamMessage:
    id: str
    timestamp_ms: int
    topic: str
    body: bytes
    stream: str
    offset: int
    key: str
    properties: dict[str, str] = field(default_factory=dict)

    @classmethod
    def _from(cls, m: pb.StreamMessage) -> StreamMessage:
        return cls(m.id, m.timestamp_ms, m.topic, m.body, m.stream, m.offset, m.key, dict(m.properties))


class StreamSubscriber(_Received[StreamMessage]):
    """Messages of a Subscribe call, received by a thread: ``get``, ``poll``, iteration."""

    def __init__(self, call: Any) -> None:
        self._reader = _StreamReader(call, lambda r: [StreamMessage._from(m) for m in r.messages])

    def take(self, n: int, timeout: float = 5.0) -> list[StreamMessage]:
        """Up to ``n`` messages, waiting at most ``timeout`` seconds for each."""
        out: list[StreamMessage] = []
        while len(out) < n:
            m = self.get(timeout)
            if m is None:
                break
            out.append(m)
        return out


class StreamsClient:
    def __init__(self, target: str = "127.0.0.1:50051", username: str | None = "guest",
                 password: str | None = "guest", vhost: str = "/", timeout: float | None = 30.0, *,
                 tls: bool = False, ca: str | bytes | None = None, cert: str | bytes | None = None,
                 key: str | bytes | None = None) -> None:
        """``tls``/``ca``/``cert``/``key``: as for leveret_client.Client (a node started with --grpc-tls)."""
        from leveret_client.client import credentials

        creds = credentials(tls, ca, cert, key)
        self._channel = (grpc.insecure_channel(target, options=_OPTIONS) if creds is None
                         else grpc.secure_channel(target, creds, options=_OPTIONS))
        self._stub = pb_grpc.StreamsStub(self._channel)
        self._md = _metadata(username, password, vhost)
        self.timeout = timeout
        self._subscribers: list[StreamSubscriber] = []

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, metadata=self._md, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise _wrap(exc) from None

    def create_stream(self, name: str, partitions: int = 0, max_age: str = "", max_bytes: int = 0,
                      exist_ok: bool = False) -> pb.StreamInfo:
        """A stream (``partitions=0``) or a partitioned stream of ``partitions`` streams."""
        return self._call(self._stub.CreateStream, pb.CreateStreamRequest(
            name=name, partitions=partitions, max_age=max_age, max_bytes=max_bytes, exist_ok=exist_ok))

    def get_stream(self, name: str) -> pb.StreamInfo:
        return self._call(self._stub.GetStream, pb.GetStreamRequest(name=name))

    def delete_stream(self, name: str) -> int:
        return int(self._call(self._stub.DeleteStream, pb.DeleteStreamRequest(name=name)).messages_dropped)

    def publish(self, topic: str, body: bytes, key: str = "", properties: dict[str, str] | None = None
                ) -> tuple[str, str, int]:
        """(id, stream, offset) once the broker has stored the message."""
        r = self._call(self._stub.Publish, pb.PublishRequest(topic=topic, body=body, key=key,
                                                             properties=properties or {}))
        return r.id, r.stream, r.offset

    def commit(self, group: str, stream: str, offset: int) -> None:
        self._call(self._stub.CommitOffset, pb.CommitOffsetRequest(group=group, stream=stream, offset=offset))

    def subscribe(self, offsets: dict[str, int], group: str = "", auto_commit: bool = False, prefetch: int = 0,
                  max_batch: int = 0, from_timestamp_ms: int = 0) -> StreamSubscriber:
        """Read ``{topic: offset}`` (an offset, or NEXT / FIRST / LAST) as one subscription."""
        call = self._stub.Subscribe(
            pb.StreamSubscribeRequest(offsets=offsets, group=group, auto_commit=auto_commit, prefetch=prefetch,
                                      max_batch=max_batch, from_timestamp_ms=from_timestamp_ms),
            metadata=self._md,
        )
        try:
            call.initial_metadata()  # in place (or refused) when this returns
        except grpc.RpcError as exc:
            raise _wrap(exc) from None
        if call.done() and call.code() != grpc.StatusCode.OK:
            raise LeveretError(call.code(), call.details() or "")
        sub = StreamSubscriber(call)
        self._subscribers.append(sub)
        return sub

    def close(self) -> None:
        for s in self._subscribers:
            s.close()
        self._subscribers.clear()
        self._channel.close()

    def __enter__(self) -> StreamsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
