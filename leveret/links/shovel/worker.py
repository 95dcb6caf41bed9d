"""One shovel: an AMQP 0-9-1 client that consumes from the source and republishes to the destination.

It runs inside the node but speaks plain AMQP to both ends (aiormq), so either
end may be this node, another Leveret or a RabbitMQ. With ``on-confirm`` a
message is acked at the source only once the destination confirmed it: a
shovel that dies (connection lost, node killed) leaves the message unacked at
the source, which redelivers it to the next session. Duplicates are possible
that way (redeliveries), losses are not. Each delivery is handled in its own
task (aiormq runs consumer callbacks as tasks), so up to ``src-prefetch-count``
messages are in flight at once rather than one confirm round trip each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec_commands

from leveret.links import identity
from leveret.links.shovel.session import CLOSE_TIMEOUT, Acks, Supervised, close, connect
from leveret.links.shovel.spec import ShovelSpec, redact

if TYPE_CHECKING:
    from core.engine.broker import Broker

log = logging.getLogger("leveret.shovel")


class Finished(Exception):
    """src-delete-after reached: the shovel deletes itself."""


class ShovelRunner(Supervised):
    """Runs one shovel until stopped or finished, reconnecting after ``reconnect-delay`` on any failure."""

    def __init__(self, spec: ShovelSpec, node: str, local_port: int,
                 on_finished: Callable[[ShovelSpec], None], broker: Broker) -> None:
        super().__init__()
        self.broker = broker  # the owner's rights, for a URI without a host (leveret/links/identity.py)
        self.task_name = f"shovel {spec.name}"
        self.spec = spec
        self.node = node
        self.local_port = local_port
        self.on_finished = on_finished
        self.shovelled = 0  # messages acked at the source (or sent, for no-ack) since the shovel started
        self._remaining: int | None = None  # src-delete-after: messages still to move
        self._in_flight = 0

    async def _run(self) -> None:
        spec = self.spec
        attempt = 0
        if isinstance(spec.delete_after, int):
            self._remaining = spec.delete_after
        while True:
            uris = (spec.src_uris[attempt % len(spec.src_uris)], spec.dest_uris[attempt % len(spec.dest_uris)])
            attempt += 1
            self._set("starting")
            try:
                await self._session(*uris)
            except Finished:
                log.info("shovel finished (src-delete-after reached)", extra={"vhost": spec.vhost, "shovel": spec.name,
                                                                               "shovelled": self.shovelled})
                self._set("terminated", "src-delete-after reached")
                self.on_finished(spec)
                return
            except asyncio.CancelledError:
                raise
            except PermissionError as exc:  # the owner may not (or no longer) use a vhost: said as it is
                log.warning("shovel stopped: its owner may not use the vhost; retried", extra={
                    "vhost": spec.vhost, "shovel": spec.name, "owner": spec.owner, "error": str(exc)})
                self._set("terminated", str(exc))
            except Exception as exc:  # noqa: BLE001  any failure of either end: report, wait, reconnect
                reason = f"{type(exc).__name__}: {exc}"
                log.warning("shovel terminated; reconnecting", extra={
                    "vhost": spec.vhost, "shovel": spec.name, "error": reason, "delay": spec.reconnect_delay})
                self._set("terminated", reason)
            await asyncio.sleep(spec.reconnect_delay)

    async def _declare(self, conn: aiormq.abc.AbstractConnection, queue: str, args: dict[str, Any]) -> int:
        """The queue's message count; declared durable (with ``args``) when it does not exist, as RabbitMQ's does."""
        probe = await conn.channel(publisher_confirms=False)
        try:
            ok = await probe.queue_declare(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            probe = await conn.channel(publisher_confirms=False)
            ok = await probe.queue_declare(queue, durable=True, arguments=args or None)
        await probe.close()
        return int(ok.message_count or 0)

    async def _session(self, src_uri: str, dest_uri: str) -> None:
        owner = self.spec.owner
        # Checked at every (re)connect: the owner's rights now, not when it set the parameter.
        src_login = identity.credentials(self.broker, owner, src_uri)
        dest_login = identity.credentials(self.broker, owner, dest_uri)
        src = await connect(src_uri, self.local_port, src_login)
        try:
            dest = await connect(dest_uri, self.local_port, dest_login)
            try:
                await self._shovel(src, dest, src_uri, dest_uri)
            finally:
                await close(dest)
        finally:
            await close(src)

    async def _shovel(self, src: aiormq.abc.AbstractConnection, dest: aiormq.abc.AbstractConnection,
                      src_uri: str, dest_uri: str) -> None:
        spec = self.spec
        confirm = spec.ack_mode == "on-confirm"
        dch = await dest.channel(publisher_confirms=confirm)
        if spec.dest_queue is not None:
            await self._declare(dest, spec.dest_queue, dict(spec.dest_queue_args))
        if spec.src_queue is not None:
            queue = spec.src_queue
            count = await self._declare(src, queue, dict(spec.src_queue_args))
            if spec.delete_after == "queue-length" and self._remaining is None:
                self._remaining = count
        sch = await src.channel(publisher_confirms=False)
        if spec.src_exchange is not None:
            ok = await sch.queue_declare("", exclusive=True, auto_delete=True)
            queue = ok.queue or ""
            await sch.queue_bind(queue, spec.src_exchange, routing_key=spec.src_exchange_key)
        if self._remaining == 0:
            raise Finished
        prefetch = spec.prefetch if self._remaining is None else min(spec.prefetch, self._remaining)
        await sch.basic_qos(prefetch_count=prefetch)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def failed(exc: BaseException) -> None:
            if not done.done():
                done.set_exception(exc)

        acks = Acks(sch, failed)
        forward = self._forward_header(src_uri, dest_uri) if spec.forward_headers else None

        async def deliver(message: DeliveredMessage) -> None:
            if self._remaining is not None:
                if self._remaining <= 0:  # over the count: back to the source, untouched
                    if spec.ack_mode != "no-ack":
                        await sch.basic_nack(message.delivery_tag or 0, requeue=True)
                    return
                self._remaining -= 1
            self._in_flight += 1
            moved = False
            try:
                moved = await handle(message)
            finally:
                self._in_flight -= 1
                if not moved and self._remaining is not None:
                    self._remaining += 1  # not moved (failed or cancelled): its slot is free again
            if self._remaining == 0 and self._in_flight == 0 and not done.done():
                await acks.flush()  # the last acks reach the source before the session closes
                done.set_exception(Finished())  # every counted message is settled at both ends

        async def handle(message: DeliveredMessage) -> bool:
            props = message.header.properties
            for attr, value in spec.publish_properties:
                setattr(props, attr, value)
            if forward is not None:
                props.headers = {**(props.headers or {}), "x-shovelled": [forward]}
            if spec.timestamp_header:
                props.headers = {**(props.headers or {}), "x-shovelled-timestamp": int(time.time())}
            exchange, key = self._route(message)
            try:
                reply = await dch.basic_publish(message.body, exchange=exchange, routing_key=key, properties=props)
                if confirm and not isinstance(reply, spec_commands.Basic.Ack):
                    raise ConnectionError(f"the destination refused the message ({type(reply).__name__})")
            except Exception as exc:  # noqa: BLE001
                failed(exc)  # unacked at the source: redelivered to the next session
                return False
            if spec.ack_mode != "no-ack":
                acks.settle(message.delivery_tag or 0)
            self.shovelled += 1
            return True

        def cancelled(frame: Any) -> None:
            # The source cancelled our consumer (its queue was deleted): reconnect, which declares it again.
            if not done.done():
                done.set_exception(ConnectionError("the source cancelled the consumer (queue deleted?)"))

        sch.on_consumer_cancel_callbacks.add(cancelled)

        def owner_changed(name: str) -> None:
            # Deleted (its connections close anyway) or no longer allowed into a direct URI's vhost: stop now.
            if name == spec.owner:
                reason = (identity.refusal(self.broker, name, src_uri)
                          or identity.refusal(self.broker, name, dest_uri))
                if reason is not None:
                    failed(PermissionError(reason))

        self.broker.on_user_changed.append(owner_changed)
        try:
            await self._consume(src, dest, sch, queue, deliver, done, acks, src_uri, dest_uri)
        finally:
            self.broker.on_user_changed.remove(owner_changed)

    async def _consume(self, src: aiormq.abc.AbstractConnection, dest: aiormq.abc.AbstractConnection,
                       sch: aiormq.abc.AbstractChannel, queue: str, deliver: Any, done: asyncio.Future[None],
                       acks: Acks, src_uri: str, dest_uri: str) -> None:
        spec = self.spec
        await sch.basic_consume(queue, deliver, no_ack=spec.ack_mode == "no-ack")
        self._set("running")
        log.info("shovel running", extra={"vhost": spec.vhost, "shovel": spec.name, "src": redact(src_uri),
                                          "dest": redact(dest_uri), "ack_mode": spec.ack_mode})
        closing = [src.closing, dest.closing, done]
        try:
            finished, _ = await asyncio.wait(closing, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Stopped (parameter cleared or changed, node stopping): ack what the destination
            # confirmed, so the next session does not deliver it again.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(acks.flush(), CLOSE_TIMEOUT)
            raise
        if done.done():  # first: the owner's refusal closes its connections too, say why
            done.result()
        for fut in finished:
            if fut is not done:
                exc = fut.exception() if not fut.cancelled() else None
                raise ConnectionError(f"{'source' if fut is src.closing else 'destination'} connection closed"
                                      + (f": {exc}" if exc else ""))

    def _route(self, message: DeliveredMessage) -> tuple[str, str]:
        spec = self.spec
        delivery = message.delivery
        key = getattr(delivery, "routing_key", None) or ""
        if spec.dest_exchange is not None:
            return spec.dest_exchange, spec.dest_exchange_key if spec.dest_exchange_key is not None else key
        if spec.dest_queue is not None:
            return "", spec.dest_queue
        return getattr(delivery, "exchange", None) or "", key

    def _forward_header(self, src_uri: str, dest_uri: str) -> dict[str, Any]:
        spec = self.spec
        out: dict[str, Any] = {"shovel-name": spec.name, "shovel-type": "dynamic", "shovel-vhost": spec.vhost,
                               "src-uri": redact(src_uri), "dest-uri": redact(dest_uri)}
        for key, value in (("src-queue", spec.src_queue), ("src-exchange", spec.src_exchange),
                           ("dest-queue", spec.dest_queue), ("dest-exchange", spec.dest_exchange)):
            if value is not None:
                out[key] = value
        return out

    def status(self) -> dict[str, Any]:
        """RabbitMQ's /api/shovels entry for this shovel."""
        spec = self.spec
        out: dict[str, Any] = {
            "node": self.node, "name": spec.name, "vhost": spec.vhost, "type": "dynamic", "state": self.state,
            "timestamp": self.timestamp(),
            "src_protocol": "amqp091", "dest_protocol": "amqp091",
            "src_uri": redact(spec.src_uris[0]), "dest_uri": redact(spec.dest_uris[0]),
            "blocked_status": self.state, "messages_shovelled": self.shovelled,
        }
        for key, value in (("src_queue", spec.src_queue), ("src_exchange", spec.src_exchange),
                           ("dest_queue", spec.dest_queue), ("dest_exchange", spec.dest_exchange)):
            if value is not None:
                out[key] = value
        if spec.src_exchange is not None:
            out["src_exchange_key"] = spec.src_exchange_key
        if spec.dest_exchange is not None and spec.dest_exchange_key is not None:
            out["dest_exchange_key"] = spec.dest_exchange_key
        if self.reason:
            out["reason"] = self.reason
        return out
