"""Credentials before the request body: the gRPC server interceptor of the public API.

gRPC reads a unary call's whole request message before it calls the method,
so four unauthenticated 120 MiB ``Push`` calls used to hold 480 MiB of the
node's memory only to be refused afterwards. The interceptor serves every
method of ``leveret.v1.Broker`` and ``leveret.v1.Streams`` as a
request-*streaming* handler instead: gRPC then reads nothing until the method
asks, and the method first checks the caller's metadata (the same login as
the servicer's, with its failed-login delay). A caller without valid
credentials is answered ``UNAUTHENTICATED`` having sent at most what HTTP/2
flow control lets it put in flight; its body is never taken. Only then is the
one request message read, and it must fit the method's limit: the calls that
carry messages (``Push``, ``PushBatch``, ``Streams.Publish``) take up to the
node's message size, every other (administrative) call at most
``ADMIN_LIMIT``. The client sees no difference: a unary request is one message
either way.

The streaming detour costs a unary Push about a third of its rate, so the
message-carrying calls whose (user, password) already logged in here, and
whose user has not changed since, keep the plain unary handler (its own login
still checks the peer's address, the vhost and permissions); credentials never
seen to work always take the detour.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from core.grpc_api.servicer import ApiError, BrokerServicer, _errors

SERVICES = ("/leveret.v1.Broker/", "/leveret.v1.Streams/")
# The calls whose request carries message bodies; everything else is small.
DATA_METHODS = frozenset({"/leveret.v1.Broker/Push", "/leveret.v1.Broker/PushBatch", "/leveret.v1.Streams/Publish"})
# An Ack of 100,000 delivery ids is ~0.5 MiB; no administrative request comes near this.
ADMIN_LIMIT = 4 * 1024 * 1024


# Credentials remembered as having logged in: at most this many, then forgotten all at once.
MAX_KNOWN = 4096


def _credentials(metadata: Any) -> tuple[str, bytes] | None:
    md = dict(metadata or ())
    username, password = md.get("username"), md.get("password")
    if not isinstance(username, str) or not isinstance(password, str):
        return None
    return username, hashlib.sha256(password.encode()).digest()


class AuthFirst(grpc.aio.ServerInterceptor):
    def __init__(self, api: BrokerServicer, data_limit: int, admin_limit: int = ADMIN_LIMIT) -> None:
        self.api = api
        self.data_limit = data_limit
        self.admin_limit = admin_limit
        self.known: set[tuple[str, bytes]] = set()  # (user, password digest) that logged in here
        api.broker.on_user_changed.append(self._forget)

    def _forget(self, username: str) -> None:
        """A changed user (password, permissions, deletion) takes the checked path again."""
        self.known = {k for k in self.known if k[0] != username}

    def remember(self, key: tuple[str, bytes] | None) -> None:
        if key is not None:
            if len(self.known) >= MAX_KNOWN:
                self.known.clear()
            self.known.add(key)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or handler.request_streaming or not method.startswith(SERVICES):
            return handler
        key = _credentials(handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        if method in DATA_METHODS:
            if key is not None and key in self.known:
                return handler  # these credentials logged in here: the hot path stays unary
            return _authenticated(handler, self, key, self.data_limit)
        return _authenticated(handler, self, key, self.admin_limit)


def _authenticated(handler: grpc.RpcMethodHandler, first: AuthFirst, key: tuple[str, bytes] | None,
                   limit: int) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer
    api = first.api

    async def request(requests: AsyncIterator[bytes], context: Any) -> Any:
        """Log in (nothing read yet), then read the one request message within ``limit``."""
        async with _errors(context):
            await api.login(context)
            first.remember(key)
            raw = await anext(aiter(requests), None)
            if raw is None:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
            if len(raw) > limit:
                raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request of {len(raw)} bytes is over this call's limit of {limit}")
            return deserialize(raw) if deserialize is not None else raw
        raise AssertionError("unreachable")

    if handler.response_streaming:
        streaming = handler.unary_stream

        async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
            async for response in streaming(await request(requests, context), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream, response_serializer=handler.response_serializer)
    unary = handler.unary_unary

    async def call(requests: AsyncIterator[bytes], context: Any) -> Any:
        return await unary(await request(requests, context), context)

    return grpc.stream_unary_rpc_method_handler(call, response_serializer=handler.response_serializer)
