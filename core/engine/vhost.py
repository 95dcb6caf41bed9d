"""A virtual host: its exchanges, queues and bindings, and routing between them."""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from core.engine import dead_letter
from core.engine.exchange import Binding, Destination, Exchange, make_exchange
from core.engine.node_stats import NodeStats
from core.engine.policy import effective_alternate, effective_queue_args
from core.engine.queue import Queue
from core.engine.queue_args import QueueArgs, check_quorum_declare, parse_queue_args, quorum_args
from core.engine.stream import StreamQueue
from core.engine.stream_args import check_stream_declare
from core.model.clock import AsyncioScheduler, Scheduler
from core.model.errors import AccessRefused, NotFound, NotImplementedFeature, PreconditionFailed, ResourceLocked
from core.model.message import Message, QueuedMessage
from core.model.policy import Policy, select

if TYPE_CHECKING:
    from core.durable.durability import Durability

log = logging.getLogger("leveret.core")

STANDARD_EXCHANGES = (
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
)

# Exchange arguments this node understands ("alternate-exchange" has no x-).
# Anything else starting with "x-" changes semantics we do not implement, so
# it is refused, not ignored (queue arguments: core/queue_args.py).
KNOWN_EXCHANGE_ARGUMENTS: frozenset[str] = frozenset()


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def server_generated_name(prefix: str = "amq.gen-") -> str:
    return prefix + base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")


class VirtualHost:
    def __init__(self, name: str, scheduler: Scheduler | None = None) -> None:
        self.name = name
        self.scheduler: Scheduler = scheduler or AsyncioScheduler()
        self.durability: Durability | None = None
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        # Observers of queue deletion (channels tracking their last-declared queue, etc.).
        self.on_queue_deleted: list[Callable[[Queue], None]] = []
        # Observers of queue creation (the native API's cluster watch).
        self.on_queue_declared: list[Callable[[Queue], None]] = []
        # Observers of an auto-delete exchange dropped because its last binding went (the cluster).
        self.on_exchange_auto_deleted: list[Callable[[VirtualHost, Exchange], None]] = []
        # Policies (core/model/policy.py), applied to live queues and exchanges as they change.
        self.policies: dict[str, Policy] = {}
        self.operator_policies: dict[str, Policy] = {}
        self.policy_alternates: dict[str, str] = {}  # exchange -> alternate exchange set by a policy
        # Writes a policy set or cleared here to the store (every node reads them from there:
        # leveret/node/policy_watch.py); set by the broker (Broker.policy_writer). (policy, cleared).
        self.policy_writer: Callable[[Policy, bool], None] | None = None
        # Observers of a policy set or cleared here through this vhost.
        self.on_policy_changed: list[Callable[[VirtualHost, Policy], None]] = []
        for xname, xtype in STANDARD_EXCHANGES:
            self.exchanges[xname] = make_exchange(xtype, xname, durable=True)
        # Runtime parameters (/api/parameters): (component, name) -> value.
        self.parameters: dict[tuple[str, str], Any] = {}
        self.description = ""
        self.tags: tuple[str, ...] = ()
        # Queue churn counters (declared, created, deleted): the broker's NodeStats once added to one.
        self.stats = NodeStats()
        self.default_published_in = 0

    # -- lookups ---------------------------------------------------------------
    def get_exchange(self, name: str) -> Exchange:
        x = self.exchanges.get(name)
        if x is None:
            raise NotFound(f"no exchange '{name}' in vhost '{self.name}'")
        return x

    def get_queue(self, name: str, owner: object | None = None) -> Queue:
        q = self.queues.get(name)
        if q is None:
            raise NotFound(f"no queue '{name}' in vhost '{self.name}'")
        if q.exclusive_owner is not None and q.exclusive_owner is not owner:
            raise self._locked(name)
        return q

    def _locked(self, name: str) -> ResourceLocked:
        return ResourceLocked(
            f"cannot obtain exclusive access to locked queue '{name}' in vhost '{self.name}'. "
            "It could be originally declared on another connection or the exclusive property "
            "value does not match that of the original declaration."
        )

    # -- exchanges -------------------------------------------------------------
    def declare_exchange(
        self,
        name: str,
        type_: str,
        passive: bool = False,
        durable: bool = False,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
        restoring: bool = False,
    ) -> Exchange:
        if name == "":
            raise AccessRefused("operation not permitted on the default exchange")
        if passive:
            return self.get_exchange(name)
        arguments = dict(arguments or {})
        existing = self.exchanges.get(name)
        if existing is None:
            self.check_new_exchange(name, type_, arguments)
            x = make_exchange(
                type_, name, durable=durable, auto_delete=auto_delete, internal=internal, arguments=arguments
            )
            self.exchanges[name] = x
            self._apply_exchange_policy(x)
            if self.durability is not None and not restoring:
                self.durability.exchange_declared(self, x)
            log.debug("exchange declared", extra={"vhost": self.name, "exchange": name, "type": type_})
            return x
        self._check_equivalent(
            "exchange",
            name,
            (("type", type_, existing.type), ("durable", durable, existing.durable),
             ("auto_delete", auto_delete, existing.auto_delete), ("internal", internal, existing.internal)),
            arguments,
            existing.arguments,
        )
        return existing

    def check_new_exchange(self, name: str, type_: str, arguments: dict[str, Any]) -> None:
        """Refuse what a declaration of a new exchange may not ask for (before the cluster agrees on it)."""
        if name == "":
            raise AccessRefused("operation not permitted on the default exchange")
        if name.startswith("amq."):
            raise AccessRefused(f"exchange name '{name}' contains reserved prefix 'amq.*'")
        for key in arguments:
            if key.startswith("x-") and key not in KNOWN_EXCHANGE_ARGUMENTS:
                raise PreconditionFailed(
                    f"unsupported exchange argument '{key}' for exchange '{name}' in vhost "
                    f"'{self.name}': this node does not implement it"
                )
        make_exchange(type_, name)  # an unknown type raises here, as it would at creation

    def check_new_queue(self, name: str, arguments: dict[str, Any], durable: bool = True, exclusive: bool = False,
                        auto_delete: bool = False) -> None:
        if name.startswith("amq.") and not name.startswith("amq.gen-"):
            raise AccessRefused(f"queue name '{name}' contains reserved prefix 'amq.*'")
        if parse_queue_args(arguments, name, self.name).quorum:
            check_quorum_declare(name, self.name, durable, exclusive, auto_delete)

    def check_exchange_deletable(self, name: str) -> None:
        """403 for the default and the standard (amq.*) exchanges."""
        if name == "" or name.startswith("amq."):
            raise AccessRefused(f"operation not permitted on exchange '{name}' in vhost '{self.name}'"
                                if name else "operation not permitted on the default exchange")

    def delete_exchange(self, name: str, if_unused: bool = False) -> None:
        self.check_exchange_deletable(name)
        x = self.exchanges.get(name)
        if x is None:
            return  # deletes are idempotent, as in RabbitMQ
        if if_unused and x.bindings:
            raise PreconditionFailed(f"exchange '{name}' in vhost '{self.name}' in use")
        self.drop_exchange(x)

    def drop_exchange(self, x: Exchange) -> None:
        """Remove ``x`` and every binding to it, with no checks (a coordinator applying a delete it agreed)."""
        x.deleted = True
        self.exchanges.pop(x.name, None)
        self.policy_alternates.pop(x.name, None)
        x.clear_bindings()
        if self.durability is not None:
            self.durability.exchange_deleted(self, x)
        # Bindings where this exchange is the destination go too.
        for other in list(self.exchanges.values()):
            for b in other.bindings_to(x):
                self._unbind(b)

    # -- queues ----------------------------------------------------------------
    def declare_queue(
        self,
        name: str,
        owner: object,
        passive: bool = False,
        durable: bool = False,
        exclusive: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        restoring: bool = False,
    ) -> Queue:
        if passive:
            return self.get_queue(name, owner)
        if not restoring:
            self.stats.queues_declared += 1
        arguments = dict(arguments or {})
        generated = name == ""
        if generated:
            name = server_generated_name()
        existing = self.queues.get(name)
        if existing is None:
            if name.startswith("amq.") and not generated and not restoring:
                raise AccessRefused(f"queue name '{name}' contains reserved prefix 'amq.*'")
            args = parse_queue_args(arguments, name, self.name)
            args = self._queue_args_with_policies(name, arguments, args)
            kind: type[Queue] = Queue
            if args.queue_type == "stream":
                check_stream_declare(name, self.name, durable and not generated, exclusive, auto_delete)
                kind = StreamQueue
            elif args.quorum:
                check_quorum_declare(name, self.name, durable, exclusive, auto_delete)
            q = kind(
                name,
                self.name,
                durable=durable,
                exclusive_owner=owner if exclusive else None,
                auto_delete=auto_delete,
                arguments=arguments,
                args=args,
                scheduler=self.scheduler,
                on_unused=self._queue_unused,
                on_dead_letter=self._dead_letter,
            )
            self.queues[name] = q
            if not restoring:
                self.stats.queues_created += 1
            if self.durability is not None:
                self.durability.queue_declared(self, q, restoring)
            # Every queue is bound to the default exchange by its name; that
            # binding is implicit (see route), not stored.
            log.debug("queue declared", extra={"vhost": self.name, "queue": name})
            for observer in list(self.on_queue_declared):
                observer(q)
            return q
        self.get_queue(name, owner)  # exclusive check -> 405
        if exclusive != existing.exclusive:
            # RabbitMQ reports an exclusive mismatch as a lock, not as 406.
            raise self._locked(name)
        self._check_equivalent(
            "queue",
            name,
            (("durable", durable, existing.durable), ("auto_delete", auto_delete, existing.auto_delete)),
            arguments,
            existing.arguments,
        )
        existing.touch()
        return existing

    def _check_equivalent(
        self,
        kind: str,
        name: str,
        fields: tuple[tuple[str, Any, Any], ...],
        args: dict[str, Any],
        current_args: dict[str, Any],
    ) -> None:
        for field, received, current in fields:
            if received != current:
                raise PreconditionFailed(
                    f"inequivalent arg '{field}' for {kind} '{name}' in vhost '{self.name}': "
                    f"received '{_fmt(received)}' but current is '{_fmt(current)}'"
                )
        for key in sorted(set(args) | set(current_args)):
            if key.startswith("x-") and args.get(key) != current_args.get(key):
                raise PreconditionFailed(
                    f"inequivalent arg '{key}' for {kind} '{name}' in vhost '{self.name}': "
                    f"received {_fmt(args.get(key))!s} but current is {_fmt(current_args.get(key))!s}"
                )

    def delete_queue(self, name: str, owner: object, if_unused: bool = False, if_empty: bool = False) -> int:
        q = self.queues.get(name)
        if q is None:
            return 0  # idempotent, as in RabbitMQ
        self.get_queue(name, owner)
        if if_empty and q.args.quorum:
            # RabbitMQ 3.10.8's words (540, a connection error).
            raise NotImplementedFeature(
                f"cannot delete queue '{name}' in vhost '{self.name}'. queue.delete operations with if-empty "
                "flag set are not supported by quorum queues")
        if if_unused and q.consumer_count:
            raise PreconditionFailed(f"queue '{name}' in vhost '{self.name}' in use")
        if if_empty and q.message_count:
            raise PreconditionFailed(f"queue '{name}' in vhost '{self.name}' not empty")
        return self.drop_queue(q)

    def drop_queue(self, q: Queue) -> int:
        """Remove ``q``, cancel its consumers (basic.cancel) and its bindings; the ready count dropped."""
        if q.deleted:
            return 0
        self.queues.pop(q.name, None)
        self.stats.queues_deleted += 1
        for x in list(self.exchanges.values()):
            for b in x.bindings_to(q):
                self._unbind(b)
        if self.durability is not None:
            self.durability.queue_deleted(self, q)
        # Unacked messages acked after this must not write to a deleted queue.
        q.storage = None
        count = q.delete()
        for observer in list(self.on_queue_deleted):
            observer(q)
        log.debug("queue deleted", extra={"vhost": self.name, "queue": q.name, "dropped": count})
        return count

    def abandon_queue(self, name: str) -> None:
        """Stop serving a queue another owner has taken (fenced): its stored data stays."""
        q = self.queues.pop(name, None)
        if q is None:
            return
        q.storage = None
        for x in list(self.exchanges.values()):
            for b in x.bindings_to(q):
                x.remove_binding(b.key)
        q.delete()
        log.warning("queue abandoned: another owner holds it", extra={"vhost": self.name, "queue": name})

    def _queue_unused(self, q: Queue) -> None:
        self.drop_queue(q)

    def drop_exclusive_queues(self, owner: object) -> None:
        for q in [q for q in self.queues.values() if q.exclusive_owner is owner]:
            self.drop_queue(q)

    def purge_queue(self, name: str, owner: object) -> int:
        return self.get_queue(name, owner).purge()

    # -- bindings --------------------------------------------------------------
    def bind(
        self,
        source: str,
        destination: Destination,
        routing_key: str,
        arguments: dict[str, Any] | None,
        restoring: bool = False,
    ) -> None:
        if source == "":
            raise AccessRefused("operation not permitted on the default exchange")
        x = self.get_exchange(source)
        b = Binding(x, destination, routing_key, arguments)
        if x.add_binding(b) and self.durability is not None and not restoring:
            self.durability.binding_changed(self, b, added=True)

    def unbind(self, source: str, destination: Destination, routing_key: str, arguments: dict[str, Any] | None) -> None:
        if source == "":
            raise AccessRefused("operation not permitted on the default exchange")
        x = self.exchanges.get(source)
        if x is None:
            return  # unbinding from a missing exchange succeeds, as in RabbitMQ
        key = Binding(x, destination, routing_key, arguments).key
        b = x.bindings.get(key)
        if b is not None:
            self._unbind(b)

    def _unbind(self, b: Binding) -> None:
        x = b.source
        x.remove_binding(b.key)
        if self.durability is not None:
            self.durability.binding_changed(self, b, added=False)
        if x.auto_delete and not x.bindings and not x.deleted:
            self.drop_exchange(x)
            for observer in list(self.on_exchange_auto_deleted):
                observer(self, x)

    # -- policies --------------------------------------------------------------
    def set_policy(self, policy: Policy, restoring: bool = False) -> None:
        """Add or replace a (user or operator) policy and apply it to existing queues and exchanges now."""
        if policy.vhost != self.name:
            raise ValueError(f"policy {policy.name!r} belongs to vhost {policy.vhost!r}, not {self.name!r}")
        table = self.operator_policies if policy.operator else self.policies
        if table.get(policy.name) == policy:
            return
        table[policy.name] = policy
        self._policies_changed(policy, restoring)

    def clear_policy(self, name: str, operator: bool = False, restoring: bool = False) -> bool:
        """Remove a policy; what it set falls back to the next policy or the queue's arguments. False: none."""
        table = self.operator_policies if operator else self.policies
        policy = table.pop(name, None)
        if policy is None:
            return False
        self._policies_changed(policy, restoring, cleared=True)
        return True

    def _policies_changed(self, policy: Policy, restoring: bool, cleared: bool = False) -> None:
        if self.policy_writer is not None and not restoring:
            self.policy_writer(policy, cleared)
        self.apply_policies()
        log.info("policy cleared" if cleared else "policy set",
                 extra={"vhost": self.name, "policy": policy.name, "operator": policy.operator})
        if not restoring:
            for observer in list(self.on_policy_changed):
                observer(self, policy)

    def policies_of(self, q: Queue) -> tuple[Policy | None, Policy | None]:
        """The policy and the operator policy that apply to ``q`` (RabbitMQ's ``policy``, ``operator_policy``)."""
        stream = q.args.queue_type == "stream"
        return (select(self.policies.values(), "queue", q.name, stream),
                select(self.operator_policies.values(), "queue", q.name, stream))

    def policy_of_exchange(self, x: Exchange) -> Policy | None:
        return select(self.policies.values(), "exchange", x.name) if x.name else None

    def apply_policies(self) -> None:
        """Recompute what every queue and exchange enforces from its arguments and the policies now."""
        for q in list(self.queues.values()):
            if q.deleted:
                continue
            parsed = parse_queue_args(q.arguments, q.name, self.name)  # accepted at declare: no error here
            q.apply_args(self._queue_args_with_policies(q.name, q.arguments, parsed))
        self.policy_alternates.clear()
        for x in self.exchanges.values():
            self._apply_exchange_policy(x)

    def _queue_args_with_policies(self, name: str, arguments: dict[str, Any], parsed: QueueArgs) -> QueueArgs:
        if not self.policies and not self.operator_policies:
            return quorum_args(parsed)
        stream = parsed.queue_type == "stream"
        return quorum_args(effective_queue_args(
            parsed, arguments, select(self.policies.values(), "queue", name, stream),
            select(self.operator_policies.values(), "queue", name, stream)))

    def _apply_exchange_policy(self, x: Exchange) -> None:
        if not self.policies:
            return
        ae = effective_alternate({}, self.policy_of_exchange(x))
        if ae is not None:
            self.policy_alternates[x.name] = ae

    # -- dead-lettering --------------------------------------------------------
    def _dead_letter(self, queue: Queue, messages: list[QueuedMessage], reason: str) -> set[int]:
        """Republish ``messages`` to ``queue``'s dead-letter exchange; the ids of those no queue took.

        (A quorum queue with at-least-once dead-lettering keeps those and retries them.)
        """
        dlx_name = queue.args.dead_letter_exchange
        if dlx_name is None:
            return set()
        exchange: Exchange | None = None
        if dlx_name not in ("", "amq.default"):
            exchange = self.exchanges.get(dlx_name)
            if exchange is None:
                log.debug("dead-letter exchange missing; message dropped",
                          extra={"vhost": self.name, "queue": queue.name, "dlx": dlx_name})
                return {id(qm) for qm in messages}
        now = self.scheduler.now()
        untaken: set[int] = set()
        for qm in messages:
            dead = dead_letter.make_dead_lettered(qm.message, queue, reason, now, dlx_name)
            targets = self.route(exchange, dead)
            if reason != dead_letter.REJECTED:
                targets = [t for t in targets if not dead_letter.is_cycle(t.name, dead.headers)]
            taken = False
            for target in targets:
                taken = target.enqueue(dead) or taken
            if not taken:
                untaken.add(id(qm))
        return untaken

    # -- routing ---------------------------------------------------------------
    def route(self, exchange: Exchange | None, message: Message) -> list[Queue]:
        """Every queue ``message`` reaches from ``exchange`` (None: the default exchange)."""
        rk = message.routing_key
        if exchange is None:
            self.default_published_in += 1  # the default exchange's publish_in (it has no Exchange object)
            q = self.queues.get(rk)
            return [q] if q is not None else []
        exchange.published_in += 1
        dests = exchange.route(rk, message)
        if not dests:
            return self._alternate(exchange, message)
        # Fast path: only queues, no exchange-to-exchange hops.
        if all(type(d) is Queue for d in dests):
            return list(dests)  # type: ignore[arg-type]
        out: list[Queue] = []
        seen_x: set[int] = {id(exchange)}
        pending = list(dests)
        while pending:
            d = pending.pop(0)
            if isinstance(d, Queue):
                if d not in out:
                    out.append(d)
            elif id(d) not in seen_x:
                seen_x.add(id(d))
                pending.extend(d.route(rk, message))
        return out

    def route_keys(self, exchange: Exchange | None, message: Message, keys: tuple[str, ...]) -> list[Queue]:
        """``route`` by each of ``keys`` (sender-selected distribution, core/engine/publish.py), each queue once.

        Exchange-to-exchange bindings are followed with every key, as RabbitMQ does; the alternate
        exchange takes the message only when no key routes anywhere, and routes it by its own key.
        """
        out: list[Queue] = []
        if exchange is None:
            for key in keys:
                q = self.queues.get(key)
                if q is not None and q not in out:
                    out.append(q)
            return out
        exchange.published_in += 1
        seen_x: set[int] = {id(exchange)}
        pending: list[Destination] = [d for key in keys for d in exchange.route(key, message)]
        if not pending:
            return self._alternate(exchange, message)
        while pending:
            d = pending.pop(0)
            if isinstance(d, Queue):
                if d not in out:
                    out.append(d)
            elif id(d) not in seen_x:
                seen_x.add(id(d))
                pending.extend(found for key in keys for found in d.route(key, message))
        return out

    def _alternate(self, exchange: Exchange, message: Message) -> list[Queue]:
        """Unroutable on ``exchange``: try its alternate exchange chain (loops stop)."""
        seen = {exchange.name}
        current = exchange
        while True:
            ae_name = current.arguments.get("alternate-exchange")
            if isinstance(ae_name, bytes):
                ae_name = ae_name.decode("utf-8", "replace")
            if ae_name is None:
                ae_name = self.policy_alternates.get(current.name)
            if not isinstance(ae_name, str) or ae_name in seen:
                return []
            ae = self.exchanges.get(ae_name)
            if ae is None:
                return []
            seen.add(ae_name)
            dests = ae.route(message.routing_key, message)
            if dests:
                return self.route(ae, message)
            current = ae
