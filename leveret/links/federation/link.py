"""One federation link: exchange X here receives what is published upstream, for the keys X's bindings ask.

Upstream (any AMQP 0-9-1 broker, through aiormq) the link declares, as
RabbitMQ's does, a queue ``federation: X to <cluster name>`` (``x-expires`` and
``x-message-ttl`` from the upstream's ``expires`` and ``message-ttl``) and an
internal fanout exchange of the same name plus `` A`` or `` B`` that feeds it.
That exchange is bound to the upstream exchange with exactly the routing keys
(and arguments) of X's bindings here, kept in step as bindings come and go
(X calls the link back on every change: ``Exchange.binding_watchers``). Each session builds the other one of A and B
from the bindings as they are now and then deletes the old one, so bindings
removed while the link was down do not linger upstream, and the queue (with
what it kept while the link was down) is never deleted.

Deliveries are republished into X in-process (core/engine/publish.py, the
node's one publish path), with an ``x-received-from`` entry prepended (uri
without password, exchange, redelivered, the upstream's cluster name and
vhost). With ``on-confirm`` a delivery is acked upstream only once the
publish here is settled (committed when a queue stores it).

Loop prevention is done here, on the downstream side, rather than by an
``x-federation-upstream`` exchange type upstream as RabbitMQ does: that type
exists only in a RabbitMQ with the federation plugin, and a link here must
work against any broker. A delivery whose ``x-received-from`` already has
``max-hops`` entries, or names this broker's cluster name and vhost, is acked
and dropped. The cost is that such messages cross the network once before
being dropped. Bindings carry RabbitMQ's ``x-bound-from`` argument with a hop
count, so a binding travels at most ``max-hops`` links and never back to where
it came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import aiormq
from aiormq.abc import DeliveredMessage

from core.engine import publish
from core.model.message import Message
from leveret.links import identity
from leveret.links.federation.spec import LinkSpec
from leveret.links.shovel.session import CLOSE_TIMEOUT, Acks, Supervised, close, connect
from leveret.links.shovel.spec import redact

if TYPE_CHECKING:
    from core.engine.broker import Broker
    from core.engine.exchange import Exchange

log = logging.getLogger("leveret.federation")
RECEIVED_FROM = "x-received-from"
BOUND_FROM = "x-bound-from"
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9\-_.:@#,/+ ]")  # what pamqp refuses in a queue or exchange name


def _text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else value


def already_seen(entries: list[Any], cluster: str, vhost: str) -> bool:
    """RabbitMQ's ``already_seen``: an entry names this cluster (and vhost, where the entry has one)."""
    for entry in entries:
        if isinstance(entry, dict) and _text(entry.get("cluster-name")) == cluster:
            seen_vhost = _text(entry.get("vhost"))
            if seen_vhost is None or seen_vhost == vhost:
                return True
    return False


def should_forward(headers: dict[str, Any] | None, max_hops: int, cluster: str, vhost: str) -> bool:
    """RabbitMQ's ``should_forward``, applied by the link to what it received."""
    entries = (headers or {}).get(RECEIVED_FROM)
    if not isinstance(entries, list):
        return True
    return len(entries) < max_hops and not already_seen(entries, cluster, vhost)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def wanted_bindings(x: Exchange, max_hops: int, cluster: str, vhost: str, upstream_cluster: str,
                    upstream_vhost: str) -> dict[Any, tuple[str, dict[str, Any]]]:
    """The upstream bindings X's bindings here ask for: {identity: (routing key, arguments)}.

    As RabbitMQ's ``update_binding``: a binding of our own goes with ``max-hops``
    hops; one another link made here (it has ``x-bound-from``) goes on with one
    hop less, and not at all back to the cluster it came from.
    """
    out: dict[Any, tuple[str, dict[str, Any]]] = {}
    for b in list(x.bindings.values()):
        args = dict(b.arguments)
        prior = args.get(BOUND_FROM)
        if isinstance(prior, list) and prior and isinstance(prior[0], dict):
            if already_seen(prior, upstream_cluster, upstream_vhost):
                continue
            prev = prior[0].get("hops")
            hops = min(prev - 1, max_hops) if isinstance(prev, int) and not isinstance(prev, bool) else 0
        else:
            prior, hops = [], max_hops
        if hops <= 0:
            continue
        args[BOUND_FROM] = [{"cluster-name": cluster, "vhost": vhost, "exchange": f"{vhost}:{x.name}",
                             "hops": hops}, *prior]
        out[(b.routing_key, _freeze(args))] = (b.routing_key, args)
    return out


def stamp(props: Any, headers: dict[str, Any], entry: dict[str, Any], trust_user_id: bool) -> None:
    """The properties of a forwarded message (pamqp's): ``entry`` prepended to ``x-received-from``, as RabbitMQ does."""
    prior = headers.get(RECEIVED_FROM)
    headers[RECEIVED_FROM] = [entry, *(prior if isinstance(prior, list) else [])]
    props.headers = headers
    if not trust_user_id:
        props.user_id = None  # RabbitMQ's default: the upstream's user-id is not vouched for here


def upstream_vhost(uri: str) -> str:
    path = urlsplit(uri).path
    return unquote(path[1:]) if len(path) > 1 else "/"


class FederationLink(Supervised):
    """Runs one link until stopped, reconnecting after ``reconnect-delay`` on any failure."""

    def __init__(self, spec: LinkSpec, broker: Broker, node: str, local_port: int,
                 cluster_name: Callable[[], str]) -> None:
        super().__init__()
        self.task_name = f"federation link {spec.exchange} <- {spec.upstream.name}"
        self.spec = spec
        self.broker = broker
        self.node = node
        self.local_port = local_port
        self.cluster_name = cluster_name
        self.uri = spec.upstream.uris[0]
        self.forwarded = 0  # republished here (and acked upstream, unless no-ack)
        self.dropped = 0  # refused by loop prevention
        self.bound = 0  # upstream bindings in place
        self.queue: str | None = None  # the upstream queue's name as the last session declared it

    def queue_name(self) -> str:
        """The upstream queue's name: RabbitMQ's ``federation: X -> <cluster name>``, spelt ``to``.

        pamqp (under aiormq) refuses names with characters outside
        ``[a-zA-Z0-9-_.:@#,/+ ]``, ``>`` among them, so ``->`` becomes ``to``
        and any other such character ``_``. This vhost is added when it is not
        ``/`` (two vhosts here may federate the same upstream exchange).
        """
        suffix = "" if self.spec.vhost == "/" else f":{self.spec.vhost}"
        return _NAME_UNSAFE.sub("_", f"federation: {self.spec.exchange} to {self.cluster_name()}{suffix}")

    async def _run(self) -> None:
        spec = self.spec
        attempt = 0
        while True:
            self.uri = spec.upstream.uris[attempt % len(spec.upstream.uris)]
            attempt += 1
            self._set("starting", self.reason)  # the last error stays visible while it tries again
            try:
                await self._session(self.uri)
            except asyncio.CancelledError:
                raise
            except PermissionError as exc:  # the upstream's owner may not (or no longer) use the vhost
                log.warning("federation link stopped: its upstream's owner may not use the vhost; retried", extra={
                    "vhost": spec.vhost, "exchange": spec.exchange, "upstream": spec.upstream.name,
                    "owner": spec.upstream.owner, "error": str(exc)})
                self._set("error", str(exc))
            except Exception as exc:  # noqa: BLE001  any failure of either side: report, wait, reconnect
                reason = f"{type(exc).__name__}: {exc}"
                log.warning("federation link failed; reconnecting", extra={
                    "vhost": spec.vhost, "exchange": spec.exchange, "upstream": spec.upstream.name,
                    "error": reason, "delay": spec.upstream.reconnect_delay})
                self._set("error", reason)
            await asyncio.sleep(spec.upstream.reconnect_delay)

    async def _session(self, uri: str) -> None:
        owner = self.spec.upstream.owner
        # Checked at every (re)connect; a URI without a host acts as the upstream's owner (links/identity.py).
        conn = await connect(uri, self.local_port, identity.credentials(self.broker, owner, uri))
        revoked: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def owner_changed(name: str) -> None:
            reason = identity.refusal(self.broker, name, uri) if name == owner else None
            if reason is not None and not revoked.done():
                revoked.set_exception(PermissionError(reason))

        self.broker.on_user_changed.append(owner_changed)
        link = asyncio.ensure_future(self._link(conn, uri))
        try:
            await asyncio.wait((link, revoked), return_when=asyncio.FIRST_COMPLETED)
            if revoked.done():
                revoked.result()  # raises: the owner lost the vhost or was deleted
            link.result()
        finally:
            self.broker.on_user_changed.remove(owner_changed)
            if not link.done():
                link.cancel()
                with contextlib.suppress(BaseException):
                    await link
            if not revoked.done():
                revoked.cancel()
            await close(conn)

    async def _channel(self, conn: aiormq.abc.AbstractConnection) -> aiormq.abc.AbstractChannel:
        return await conn.channel(publisher_confirms=False)

    async def _ensure_exchange(self, conn: aiormq.abc.AbstractConnection) -> None:
        """The upstream exchange: used as it is, declared like X (type, durability) when missing."""
        spec = self.spec
        try:
            ch = await self._channel(conn)
            await ch.exchange_declare(spec.upstream_exchange, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            ch = await self._channel(conn)
            await ch.exchange_declare(spec.upstream_exchange, exchange_type=spec.exchange_type, durable=spec.durable)
        await ch.close()

    async def _link(self, conn: aiormq.abc.AbstractConnection, uri: str) -> None:
        spec, up = self.spec, self.spec.upstream
        me, my_vhost = self.cluster_name(), spec.vhost
        their = _text((conn.server_properties or {}).get("cluster_name")) or urlsplit(uri).netloc.rpartition("@")[2]
        their_vhost = upstream_vhost(uri)
        if their == me and their_vhost == my_vhost:
            raise ConnectionError(f"the upstream's cluster name is this broker's own ({me!r}): loop prevention would "
                                  "drop everything; give each broker its own name (PUT /api/cluster-name)")
        await self._ensure_exchange(conn)
        ch = await self._channel(conn)
        queue = self.queue = self.queue_name()
        args: dict[str, Any] = {}
        if up.expires is not None:
            args["x-expires"] = up.expires
        if up.message_ttl is not None:
            args["x-message-ttl"] = up.message_ttl
        await ch.queue_declare(queue, durable=spec.durable, arguments=args or None)
        # The feeding exchange: a fresh one of A and B, then the old one deleted (see the module's docstring).
        old, new = f"{queue} A", f"{queue} B"
        probe = await self._channel(conn)
        try:
            await probe.exchange_declare(old, passive=True)
            await probe.close()
        except aiormq.exceptions.ChannelNotFoundEntity:
            old, new = new, old
        await ch.exchange_delete(new)
        await ch.exchange_declare(new, exchange_type="fanout", durable=spec.durable, internal=True)
        await ch.queue_bind(queue, new, routing_key="")
        bound: dict[Any, tuple[str, dict[str, Any]]] = {}

        async def sync() -> None:
            x = self._exchange()
            want = wanted_bindings(x, up.max_hops, me, my_vhost, their, their_vhost)
            for key in want.keys() - bound.keys():
                rk, bargs = want[key]
                await ch.exchange_bind(new, spec.upstream_exchange, routing_key=rk, arguments=bargs)
                bound[key] = want[key]
            for key in bound.keys() - want.keys():
                rk, bargs = bound.pop(key)
                await ch.exchange_unbind(new, spec.upstream_exchange, routing_key=rk, arguments=bargs)
            self.bound = len(bound)

        await sync()
        await ch.exchange_delete(old)
        await self._consume(conn, ch, queue, uri, their, their_vhost, sync)

    def _exchange(self) -> Exchange:
        vh = self.broker.vhosts.get(self.spec.vhost)
        x = vh.exchanges.get(self.spec.exchange) if vh is not None else None
        if x is None:
            raise LookupError(f"exchange {self.spec.exchange!r} is gone from vhost {self.spec.vhost!r}")
        return x

    async def _consume(self, conn: aiormq.abc.AbstractConnection, ch: aiormq.abc.AbstractChannel, queue: str,
                       uri: str, their: str, their_vhost: str, sync: Callable[[], Any]) -> None:
        spec, up = self.spec, self.spec.upstream
        me = self.cluster_name()
        confirm = up.ack_mode == "on-confirm"
        no_ack = up.ack_mode == "no-ack"
        await ch.basic_qos(prefetch_count=up.prefetch)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def failed(exc: BaseException) -> None:
            if not done.done():
                done.set_exception(exc)

        acks = Acks(ch, failed)
        source = {"uri": redact(uri), "exchange": spec.upstream_exchange, "cluster-name": their,
                  "vhost": their_vhost}
        vh = self.broker.vhosts[spec.vhost]

        async def deliver(message: DeliveredMessage) -> None:
            tag = message.delivery_tag or 0
            props = message.header.properties
            headers = dict(props.headers or {})
            if not should_forward(headers, up.max_hops, me, spec.vhost):
                self.dropped += 1
                if not no_ack:
                    acks.settle(tag)
                return
            stamp(props, headers, {**source, "redelivered": bool(getattr(message.delivery, "redelivered", False))},
                  up.trust_user_id)
            await self.broker.alarms.wait_clear()  # a memory or disk alarm here holds the link as it holds publishers
            try:
                x = self._exchange()
                msg = Message(spec.exchange, getattr(message.delivery, "routing_key", "") or "", props.marshal(),
                              message.body, node=self.node)
                outcome = publish.publish(self.broker, vh, x, msg, track=confirm)
                if confirm and not await outcome.wait():
                    raise ConnectionError(f"the downstream publish failed: {outcome.error}")
            except Exception as exc:  # noqa: BLE001  unacked upstream: redelivered to the next session
                failed(exc)
                return
            self.forwarded += 1
            if not no_ack:
                acks.settle(tag)

        def cancelled(frame: Any) -> None:
            if not done.done():
                done.set_exception(ConnectionError("the upstream cancelled the consumer (queue deleted?)"))

        # X tells us when its bindings change (Exchange.binding_watchers); a burst of changes is one sync.
        # Dropping X wakes it too: sync's lookup then fails the session, and the next one finds the new X.
        changed = asyncio.Event()
        watched = self._exchange()
        watched.binding_watchers.append(changed.set)

        async def keep_bindings() -> None:
            while True:
                await changed.wait()
                changed.clear()
                await sync()

        ch.on_consumer_cancel_callbacks.add(cancelled)
        await ch.basic_consume(queue, deliver, no_ack=no_ack)
        self._set("running")
        log.info("federation link running", extra={
            "vhost": spec.vhost, "exchange": spec.exchange, "upstream": up.name, "uri": redact(uri),
            "upstream_cluster": their, "ack_mode": up.ack_mode})
        keeper = asyncio.get_running_loop().create_task(keep_bindings())
        try:
            finished, _ = await asyncio.wait([conn.closing, done, keeper], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Stopped (policy or upstream changed, node stopping): ack what is settled here.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(acks.flush(), CLOSE_TIMEOUT)
            raise
        finally:
            keeper.cancel()
            watched.binding_watchers.remove(changed.set)
        for fut in finished:
            if fut is conn.closing:
                exc = fut.exception() if not fut.cancelled() else None
                raise ConnectionError("upstream connection closed" + (f": {exc}" if exc else ""))
            fut.result()

    async def unlink(self) -> None:
        """The link is no longer wanted (policy, upstream or exchange gone): stop the upstream queue filling.

        The feeding exchanges go, so nothing more is routed to the queue; the
        queue itself stays with what it holds (``expires`` removes it), since
        deleting it on a passing state would lose messages.
        """
        conn = await connect(self.uri, self.local_port,
                             identity.credentials(self.broker, self.spec.upstream.owner, self.uri))
        try:
            ch = await self._channel(conn)
            for suffix in (" A", " B"):
                await ch.exchange_delete(f"{self.queue or self.queue_name()}{suffix}")
        finally:
            await close(conn)
        log.info("federation link removed upstream bindings", extra={
            "vhost": self.spec.vhost, "exchange": self.spec.exchange, "upstream": self.spec.upstream.name})

    def status(self) -> dict[str, Any]:
        """RabbitMQ's /api/federation-links entry for this link."""
        spec = self.spec
        out: dict[str, Any] = {
            "node": self.node, "exchange": spec.exchange, "upstream_exchange": spec.upstream_exchange,
            "type": "exchange", "vhost": spec.vhost, "upstream": spec.upstream.name, "id": spec.id,
            "status": self.state, "local_connection": local_connection(spec), "uri": redact(self.uri),
            "timestamp": self.timestamp(), "messages_forwarded": self.forwarded,
            "messages_dropped_by_loop_prevention": self.dropped, "bindings": self.bound,
        }
        if self.reason:
            out["error"] = self.reason
        return out


def local_connection(spec: LinkSpec) -> str:
    """RabbitMQ names the link's downstream connection so; here the link publishes in-process."""
    return f"Federation link (upstream: {spec.upstream.name}, policy: {spec.policy})"
