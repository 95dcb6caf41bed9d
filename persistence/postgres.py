"""The PostgreSQL message store (psycopg 3, async, over a small connection pool).

Every ``commit`` is one transaction that first locks the epoch rows of the
batch's queues (``FOR SHARE``) and refuses the whole batch when any of them has
moved on; a ``claim`` updates the row, so it waits for commits in flight and
every commit after it sees the new epoch (DESIGN.md, "Ownership and failover").

Appends go through ``COPY ... (FORMAT BINARY)``: for 1000 appends of 256 bytes
it measured ~13 ms against ~48 ms for ``executemany`` (~3.7x; 10k: ~135 ms
against ~440 ms). COPY cannot skip rows that exist already, so a batch whose
earlier commit did reach the server (the connection dropped before the reply and
the caller retried) fails with a unique violation; it is then applied again
through a staging table and ``INSERT ... ON CONFLICT DO NOTHING``, which makes a
retried commit idempotent.

Within a batch, purges are applied first, then appends, delivery counts and
removals: a message appended and settled inside one batch is never stored, and
a purge never drops a message of the same batch (at worst one published
before the purge survives it, which at-least-once allows; dropping one
published after it would lose a confirmed message).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from core.model.fieldtable import FieldTable, decode_table, encode_table
from core.model.policy import Policy
from core.ports.store import (
    Batch,
    BindingRecord,
    ExchangeRecord,
    Fenced,
    QueueRecord,
    StoredMessage,
    StoreError,
    Topology,
    TopologyWrite,
    UserRecord,
)
from persistence.policy_rows import stored_policy
from persistence.schema import POSTGRES_MIGRATIONS, apply_postgres

MIGRATIONS = POSTGRES_MIGRATIONS

DEFAULT_CONNECT_TIMEOUT = 5.0  # seconds, when the DSN does not say
log = logging.getLogger("leveret.store")

# How long a claim waits for a row lock before it ends a stalled holder's session.
CLAIM_PATIENCE = 0.3
ACQUIRE_TIMEOUT = 10.0  # seconds to wait for a pooled connection before failing a call
# A commit (including the wait for a pooled connection) that takes longer fails: its
# publishes are nacked and its connection is dropped and made again. A server that
# accepts TCP but never answers (a hung backend, a middlebox that ACKs for a dead
# host, bench/chaos_proxy.py's blackhole) defeats tcp_user_timeout and keepalives,
# since every byte is acknowledged: without a bound the commit, and every confirm
# behind it, waited for the whole outage (bench.chaos, 30 s outage: 126 publishes
# unanswered past the client's 10 s confirm timeout). A healthy commit takes
# milliseconds here (group commits of a few hundred messages); 5 s leaves room for
# a loaded server and large bodies, and stays under the 10 s confirm timeouts
# clients commonly use, so the publisher sees a nack rather than a timeout.
DEFAULT_COMMIT_TIMEOUT = 5.0

_MESSAGE_COLUMNS = (
    'vhost, queue, "offset", message_id, exchange, routing_key, properties, body, '
    "enqueued_at, expires_at, size, delivery_count"
)
_COPY_TYPES = ["text", "text", "int8", "text", "text", "text", "bytea", "bytea", "float8", "float8", "int4", "int4"]

# -- DSN redaction -------------------------------------------------------------------

_KV_PASSWORD = re.compile(r"""(^|\s)password\s*=\s*(?:'(?:[^'\\]|\\.)*'|\S*)""", re.IGNORECASE)


def redact_dsn(dsn: str) -> str:
    """The DSN without its password, for logs and errors (URL and key=value forms)."""
    scheme, sep, rest = dsn.partition("://")
    if not sep:
        return " ".join(_KV_PASSWORD.sub(r"\1", dsn).split())
    head, qmark, query = rest.partition("?")
    at = head.rfind("@")
    if at >= 0:
        user = head[:at].split(":", 1)[0]
        head = (user + "@" if user else "") + head[at + 1 :]
    if qmark:
        params = [p for p in query.split("&") if p and p.split("=", 1)[0].lower() != "password"]
        query = "&".join(params)
    return f"{scheme}://{head}" + (f"?{query}" if query else "")


def _dsn_password(dsn: str) -> str | None:
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        return None
    return str(password) if password else None


# -- field tables ----------------------------------------------------------------------


def _encode_arguments(arguments: FieldTable | None) -> bytes:
    return encode_table(arguments or {})


def _decode_arguments(raw: bytes | None) -> FieldTable:
    if not raw:
        return {}
    table, _ = decode_table(bytes(raw))
    return table


def binding_arguments_key(arguments: FieldTable | None) -> str:
    """Hex SHA-1 of the binding's encoded arguments: tells apart bindings that differ only there (headers)."""
    return hashlib.sha1(_encode_arguments(arguments)).hexdigest()


# -- the store ---------------------------------------------------------------------------


class PostgresStore:
    """MessageStore on PostgreSQL."""

    def __init__(self, dsn: str, pool_size: int = 4, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 commit_timeout: float = DEFAULT_COMMIT_TIMEOUT) -> None:
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        if commit_timeout < 0:
            raise ValueError("commit_timeout must be 0 (no limit) or more")
        self._commit_timeout = commit_timeout
        self._dsn = dsn
        self._pool_size = pool_size
        self._connect_timeout = connect_timeout
        self._password = _dsn_password(dsn)
        self.description = f"postgres {redact_dsn(dsn)}"
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None

    # -- errors ----------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        if self._password:
            text = text.replace(self._password, "***")
        return text

    def _error(self, what: str, exc: BaseException) -> StoreError:
        reason = self._scrub(" ".join(str(exc).split())) or type(exc).__name__
        return StoreError(f"{self.description}: {what} failed: {reason}")

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Turn driver and network failures into StoreError naming the (redacted) DSN."""
        try:
            yield
        except StoreError:
            raise
        except (psycopg.Error, OSError, TimeoutError) as exc:
            raise self._error(what, exc) from exc

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._pool is None:
            raise StoreError(f"{self.description}: the store is not open")
        async with self._pool.connection(timeout=ACQUIRE_TIMEOUT) as conn:
            yield conn

    # -- life cycle --------------------------------------------------------------------
    def _connect_kwargs(self) -> dict[str, Any]:
        try:
            given = conninfo_to_dict(self._dsn)
        except psycopg.Error as exc:
            raise StoreError(f"{self.description}: invalid connection string: {self._scrub(str(exc))}") from exc
        kwargs: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" not in given:
            kwargs["connect_timeout"] = max(2, math.ceil(self._connect_timeout))  # libpq: whole seconds, >= 2
        if "application_name" not in given:
            kwargs["application_name"] = "leveret"
        # A server that stops answering (a partition, a host gone without a reset) must fail
        # the commit waiting on it, so its publishes are nacked, not left unanswered until
        # it returns (seen by bench.chaos): data unacknowledged for 10 s breaks the socket,
        # and keepalives find a dead idle connection within ~11 s. The DSN may set its own.
        for key, value in (("tcp_user_timeout", 10_000), ("keepalives", 1), ("keepalives_idle", 5),
                           ("keepalives_interval", 2), ("keepalives_count", 3)):
            if key not in given:
                kwargs[key] = value
        # A node paused in the middle of a transaction (SIGSTOP, a VM freeze)
        # holds its queue_epochs row lock; the next owner's fencing claim must
        # not wait for it to wake. The server ends such a transaction after a
        # second (its commit then fails: nacks, never a false confirm), and no
        # statement waits on a lock for more than five.
        fence = "-c idle_in_transaction_session_timeout=1000 -c lock_timeout=5000"
        kwargs["options"] = f"{given['options']} {fence}" if given.get("options") else fence
        return kwargs

    async def open(self) -> None:
        if self._pool is not None:
            return
        kwargs = self._connect_kwargs()
        # One direct connection first: it reports why the server is unreachable (the
        # pool would only time out), and it applies the migrations.
        deadline = float(kwargs.get("connect_timeout", self._connect_timeout)) * 2 + 5
        try:
            conn = await asyncio.wait_for(psycopg.AsyncConnection.connect(self._dsn, **kwargs), deadline)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            raise StoreError(f"cannot connect to {self.description}: {self._scrub(' '.join(str(exc).split()))}")
        with self._guard("applying migrations"):
            async with conn:
                await apply_postgres(conn, MIGRATIONS)
        pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            self._dsn,
            min_size=self._pool_size,
            max_size=self._pool_size,
            kwargs=kwargs,
            open=False,
            name="leveret-store",
            timeout=ACQUIRE_TIMEOUT,
        )
        try:
            with self._guard("opening the connection pool"):
                await pool.open(wait=True, timeout=deadline)
        except StoreError:
            await pool.close()
            raise
        self._pool = pool

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    # -- topology ------------------------------------------------------------------------
    async def load_topology(self) -> Topology:
        topology = Topology()
        with self._guard("loading the topology"):
            async with self._connection() as conn, conn.transaction():
                await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                cur = conn.cursor(binary=True)
                await cur.execute(
                    "SELECT vhost, name, type, auto_delete, internal, arguments FROM exchanges ORDER BY vhost, name"
                )
                for vhost, name, type_, auto_delete, internal, arguments in await cur.fetchall():
                    topology.exchanges.append(
                        ExchangeRecord(vhost, name, type_, auto_delete, internal, _decode_arguments(arguments))
                    )
                await cur.execute("SELECT vhost, name, auto_delete, arguments FROM queues ORDER BY vhost, name")
                for vhost, name, auto_delete, arguments in await cur.fetchall():
                    topology.queues.append(QueueRecord(vhost, name, auto_delete, _decode_arguments(arguments)))
                await cur.execute(
                    "SELECT vhost, source, destination_kind, destination, routing_key, arguments FROM bindings"
                    " ORDER BY vhost, source, destination_kind, destination, routing_key, arguments_key"
                )
                for vhost, source, kind, destination, routing_key, arguments in await cur.fetchall():
                    topology.bindings.append(
                        BindingRecord(vhost, source, kind, destination, routing_key, _decode_arguments(arguments))
                    )
        return topology

    async def save_exchange(self, record: ExchangeRecord) -> None:
        with self._guard(f"saving exchange {record.vhost}/{record.name}"):
            async with self._connection() as conn:
                await conn.execute(
                    "INSERT INTO exchanges (vhost, name, type, auto_delete, internal, arguments)"
                    " VALUES (%s, %s, %s, %s, %s, %s)"
                    " ON CONFLICT (vhost, name) DO UPDATE SET type = EXCLUDED.type,"
                    " auto_delete = EXCLUDED.auto_delete, internal = EXCLUDED.internal, arguments = EXCLUDED.arguments",
                    (
                        record.vhost,
                        record.name,
                        record.type,
                        record.auto_delete,
                        record.internal,
                        _encode_arguments(record.arguments),
                    ),
                )

    async def delete_exchange(self, vhost: str, name: str) -> None:
        with self._guard(f"deleting exchange {vhost}/{name}"):
            async with self._connection() as conn, conn.transaction():
                await conn.execute(
                    "DELETE FROM bindings WHERE vhost = %s"
                    " AND (source = %s OR (destination_kind = 'exchange' AND destination = %s))",
                    (vhost, name, name),
                )
                await conn.execute("DELETE FROM exchanges WHERE vhost = %s AND name = %s", (vhost, name))

    async def save_queue(self, record: QueueRecord) -> None:
        with self._guard(f"saving queue {record.vhost}/{record.name}"):
            async with self._connection() as conn:
                await conn.execute(
                    "INSERT INTO queues (vhost, name, auto_delete, arguments) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (vhost, name) DO UPDATE SET auto_delete = EXCLUDED.auto_delete,"
                    " arguments = EXCLUDED.arguments",
                    (record.vhost, record.name, record.auto_delete, _encode_arguments(record.arguments)),
                )

    async def delete_queue(self, vhost: str, name: str) -> None:
        with self._guard(f"deleting queue {vhost}/{name}"):
            async with self._connection() as conn, conn.transaction():
                # The epoch row first: it waits for a commit in flight (which holds it FOR
                # SHARE), in the same lock order as commit, and fences every later one.
                await conn.execute("DELETE FROM queue_epochs WHERE vhost = %s AND queue = %s", (vhost, name))
                await conn.execute("DELETE FROM messages WHERE vhost = %s AND queue = %s", (vhost, name))
                await conn.execute("DELETE FROM stream_offsets WHERE vhost = %s AND queue = %s", (vhost, name))
                await conn.execute(
                    "DELETE FROM bindings WHERE vhost = %s AND destination_kind = 'queue' AND destination = %s",
                    (vhost, name),
                )
                await conn.execute("DELETE FROM queues WHERE vhost = %s AND name = %s", (vhost, name))

    async def save_binding(self, record: BindingRecord) -> None:
        with self._guard(f"saving binding {record.vhost}/{record.source} -> {record.destination}"):
            async with self._connection() as conn:
                await conn.execute(
                    "INSERT INTO bindings"
                    " (vhost, source, destination_kind, destination, routing_key, arguments, arguments_key)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
                    " ON CONFLICT (vhost, source, destination_kind, destination, routing_key, arguments_key)"
                    " DO UPDATE SET arguments = EXCLUDED.arguments",
                    (
                        record.vhost,
                        record.source,
                        record.destination_kind,
                        record.destination,
                        record.routing_key,
                        _encode_arguments(record.arguments),
                        binding_arguments_key(record.arguments),
                    ),
                )

    async def delete_binding(self, record: BindingRecord) -> None:
        with self._guard(f"deleting binding {record.vhost}/{record.source} -> {record.destination}"):
            async with self._connection() as conn:
                await conn.execute(
                    "DELETE FROM bindings WHERE vhost = %s AND source = %s AND destination_kind = %s"
                    " AND destination = %s AND routing_key = %s AND arguments_key = %s",
                    (
                        record.vhost,
                        record.source,
                        record.destination_kind,
                        record.destination,
                        record.routing_key,
                        binding_arguments_key(record.arguments),
                    ),
                )

    # -- users and vhosts ------------------------------------------------------------
    async def load_users(self) -> list[UserRecord]:
        with self._guard("loading users"):
            async with self._connection() as conn:
                cur = await conn.execute(
                    "SELECT name, salt, password_hash, tags, vhosts, loopback_only, permissions"
                    " FROM users ORDER BY name"
                )
                rows = await cur.fetchall()
        return [
            UserRecord(name, bytes(salt), bytes(digest), json.loads(tags), json.loads(vhosts), bool(loopback),
                       json.loads(perms))
            for name, salt, digest, tags, vhosts, loopback, perms in rows
        ]

    async def save_user(self, record: UserRecord) -> None:
        with self._guard(f"saving user {record.name}"):
            async with self._connection() as conn:
                await conn.execute(
                    "INSERT INTO users (name, salt, password_hash, tags, vhosts, loopback_only, permissions)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (name) DO UPDATE SET salt = EXCLUDED.salt,"
                    " password_hash = EXCLUDED.password_hash, tags = EXCLUDED.tags, vhosts = EXCLUDED.vhosts,"
                    " loopback_only = EXCLUDED.loopback_only, permissions = EXCLUDED.permissions",
                    (record.name, record.salt, record.password_hash, json.dumps(record.tags),
                     json.dumps(record.vhosts), record.loopback_only, json.dumps(record.permissions)),
                )  # fmt: skip

    async def delete_user(self, name: str) -> bool:
        with self._guard(f"deleting user {name}"):
            async with self._connection() as conn:
                cur = await conn.execute("DELETE FROM users WHERE name = %s", (name,))
                return cur.rowcount > 0

    async def load_policies(self) -> list[Policy]:
        with self._guard("loading policies"):
            async with self._connection() as conn:
                cur = await conn.execute(
                    "SELECT vhost, name, operator, pattern, apply_to, priority, definition FROM policies"
                    " ORDER BY vhost, operator, name"
                )
                rows = await cur.fetchall()
        return [stored_policy(vhost, name, bool(operator), pattern, apply_to, int(priority), definition)
                for vhost, name, operator, pattern, apply_to, priority, definition in rows]

    async def save_policy(self, policy: Policy) -> None:
        with self._guard(f"saving policy {policy.name}"):
            async with self._connection() as conn:
                await conn.execute(
                    "INSERT INTO policies (vhost, name, operator, pattern, apply_to, priority, definition, updated_at)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (vhost, operator, name) DO UPDATE SET"
                    " pattern = EXCLUDED.pattern, apply_to = EXCLUDED.apply_to, priority = EXCLUDED.priority,"
                    " definition = EXCLUDED.definition, updated_at = EXCLUDED.updated_at",
                    (policy.vhost, policy.name, policy.operator, policy.pattern, policy.apply_to, policy.priority,
                     json.dumps(policy.definition), time.time()),
                )  # fmt: skip

    async def delete_policy(self, vhost: str, name: str, operator: bool) -> bool:
        with self._guard(f"deleting policy {name}"):
            async with self._connection() as conn:
                cur = await conn.execute("DELETE FROM policies WHERE vhost = %s AND name = %s AND operator = %s",
                                         (vhost, name, operator))
                return cur.rowcount > 0

    async def load_parameters(self) -> list[tuple[str, str, str, Any]]:
        with self._guard("loading runtime parameters"):
            async with self._connection() as conn:
                cur = await conn.execute("SELECT vhost, component, name, value FROM runtime_parameters"
                                         " ORDER BY vhost, component, name")
                rows = await cur.fetchall()
        return [(vhost, component, name, json.loads(value)) for vhost, component, name, value in rows]

    async def save_parameter(self, vhost: str, component: str, name: str, value: Any) -> None:
        with self._guard(f"saving parameter {component}/{name}"):
            async with self._connection() as conn:
                await conn.execute(
                    "INSERT INTO runtime_parameters (vhost, component, name, value) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (vhost, component, name) DO UPDATE SET value = EXCLUDED.value",
                    (vhost, component, name, json.dumps(value)))

    async def delete_parameter(self, vhost: str, component: str, name: str) -> bool:
        with self._guard(f"deleting parameter {component}/{name}"):
            async with self._connection() as conn:
                cur = await conn.execute("DELETE FROM runtime_parameters WHERE vhost = %s AND component = %s"
                                         " AND name = %s", (vhost, component, name))
                return cur.rowcount > 0

    async def load_vhosts(self) -> list[str]:
        with self._guard("loading vhosts"):
            async with self._connection() as conn:
                cur = await conn.execute("SELECT name FROM vhosts ORDER BY name")
                return [str(r[0]) for r in await cur.fetchall()]

    async def save_vhost(self, name: str) -> None:
        with self._guard(f"saving vhost {name}"):
            async with self._connection() as conn:
                await conn.execute("INSERT INTO vhosts (name) VALUES (%s) ON CONFLICT (name) DO NOTHING", (name,))

    async def load_vhost_limits(self) -> dict[str, dict[str, int]]:
        with self._guard("loading vhost limits"):
            async with self._connection() as conn:
                cur = await conn.execute("SELECT vhost, limits FROM vhost_limits ORDER BY vhost")
                return {str(name): json.loads(limits) for name, limits in await cur.fetchall()}

    async def save_vhost_limits(self, name: str, limits: dict[str, int]) -> None:
        with self._guard(f"saving the limits of vhost {name}"):
            async with self._connection() as conn:
                if limits:
                    await conn.execute("INSERT INTO vhost_limits (vhost, limits) VALUES (%s, %s)"
                                       " ON CONFLICT (vhost) DO UPDATE SET limits = EXCLUDED.limits",
                                       (name, json.dumps(limits)))
                else:
                    await conn.execute("DELETE FROM vhost_limits WHERE vhost = %s", (name,))

    async def delete_vhost(self, name: str) -> bool:
        with self._guard(f"deleting vhost {name}"):
            async with self._connection() as conn, conn.transaction():
                # Epoch rows first, in the lock order of commit and delete_queue.
                await conn.execute("DELETE FROM queue_epochs WHERE vhost = %s", (name,))
                for table in ("messages", "bindings", "queues", "exchanges"):
                    await conn.execute(f"DELETE FROM {table} WHERE vhost = %s", (name,))  # type: ignore[arg-type]
                cur = await conn.execute("DELETE FROM vhosts WHERE name = %s", (name,))
                return cur.rowcount > 0

    # -- ownership and messages -------------------------------------------------------
    async def claim(self, vhost: str, queue: str, epoch: int | None = None) -> int:
        with self._guard(f"claiming {vhost}/{queue}"):
            async with self._connection() as conn:
                if epoch is None:
                    cur = await conn.execute(
                        "INSERT INTO queue_epochs (vhost, queue, epoch) VALUES (%s, %s, 1)"
                        " ON CONFLICT (vhost, queue) DO UPDATE SET epoch = queue_epochs.epoch + 1"
                        " RETURNING epoch",
                        (vhost, queue),
                    )
                else:
                    # Moves to ``epoch`` when it is newer; an equal epoch is an idempotent re-claim.
                    claim = asyncio.ensure_future(conn.execute(
                        "INSERT INTO queue_epochs (vhost, queue, epoch) VALUES (%s, %s, %s)"
                        " ON CONFLICT (vhost, queue) DO UPDATE SET epoch = EXCLUDED.epoch"
                        " WHERE queue_epochs.epoch <= EXCLUDED.epoch"
                        " RETURNING epoch",
                        (vhost, queue, epoch),
                    ))
                    await self._unblock(claim, conn.info.backend_pid)
                    cur = await claim
                row = await cur.fetchone()
        if row is None:
            raise Fenced([(vhost, queue)])
        return int(row[0])

    async def _unblock(self, claim: asyncio.Future[Any], waiter_pid: int) -> None:
        """End the sessions of an older owner that block a claim.

        A cluster node claims a queue only after etcd gave it the owner key:
        the previous owner lost its lease. If that node was paused in the
        middle of a commit, its session still holds the row lock the claim
        needs and would hold it until the node wakes up. Its transaction can
        only fail now (its epoch is stale), so it is ended, which releases the
        lock. Only Leveret node sessions (application_name 'leveret') are ended.
        """
        while not claim.done():
            await asyncio.wait({claim}, timeout=CLAIM_PATIENCE)
            if claim.done():
                return
            async with self._connection() as other:
                cur = await other.execute(
                    "SELECT a.pid, pg_terminate_backend(a.pid) FROM pg_stat_activity a"
                    " WHERE a.pid = ANY(pg_blocking_pids(%s)) AND a.application_name = 'leveret'",
                    (waiter_pid,),
                )
                ended = [pid for pid, _ in await cur.fetchall()]
            if ended:
                log.warning("ended a stalled previous owner's store sessions to claim the queue",
                            extra={"pids": ended})

    async def load_messages(self, vhost: str, queue: str) -> list[StoredMessage]:
        with self._guard(f"loading the messages of {vhost}/{queue}"):
            async with self._connection() as conn:
                cur = conn.cursor(binary=True)
                await cur.execute(
                    'SELECT "offset", message_id, exchange, routing_key, properties, body, enqueued_at, expires_at,'
                    " delivery_count FROM messages WHERE vhost = %s AND queue = %s AND state = 'ready'"
                    ' ORDER BY "offset"',
                    (vhost, queue),
                )
                rows = await cur.fetchall()
        return [
            StoredMessage(vhost, queue, offset, message_id, exchange, routing_key, properties, body,
                          enqueued_at, expires_at, delivery_count)
            for offset, message_id, exchange, routing_key, properties, body, enqueued_at, expires_at, delivery_count
            in rows
        ]  # fmt: skip

    async def commit(self, batch: Batch) -> None:
        if not batch.epochs and not len(batch):
            return
        _require_epochs(batch)
        parts = _split(batch, self._pool_size)
        if len(parts) > 1:
            await self._commit_parts(parts)
            return
        await self._commit_one(batch)

    async def _commit_parts(self, parts: list[Batch]) -> None:
        """Commit the parts of one large batch on several connections at once.

        One backend copying large bodies is CPU-bound in the server (TOAST
        chunking, WAL); parts in parallel use the other cores. The batch
        succeeds only when every part has committed; a failed part fails the
        whole batch (its publishes are nacked, so a message of a part that did
        commit may be published again: at least once, never lost). Every part
        checks the epochs itself, so fencing holds for each.
        """
        results = await asyncio.gather(*(self._commit_one(p) for p in parts), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        fenced = [e for e in errors if isinstance(e, Fenced)]
        if fenced:
            raise fenced[0]
        if errors:
            raise errors[0]

    async def _commit_one(self, batch: Batch) -> None:
        with self._guard(f"committing a batch of {len(batch)}"):
            try:
                await self._bounded_commit(batch, idempotent=False)
            except psycopg.errors.UniqueViolation:
                # Some appends are stored already: a retry of a batch whose commit did
                # reach the server. Apply it again, skipping the messages it holds.
                await self._bounded_commit(batch, idempotent=True)

    async def _bounded_commit(self, batch: Batch, *, idempotent: bool) -> None:
        """``_commit`` within ``commit_timeout`` (see DEFAULT_COMMIT_TIMEOUT), else StoreError.

        Cancelling the commit alone is no way out: the transaction's exit then
        sends ROLLBACK to the server that does not answer, and waits again. So
        the connection's socket is shut down first: libpq sees the connection
        end, the commit fails at once, and the pool discards the broken
        connection and makes a new one. Shut down, not closed: an fd closed
        under the event loop that watches it is what libuv (uvloop) meets with
        abort() when its epoll_ctl fails unexpectedly, and bench.chaos lost a
        node to a silent SIGABRT right after a commit timeout that closed it
        (not reproduced alone: 90 timeouts in a row did not crash); psycopg
        closes the fd itself on its error path.
        Whether the server committed is unknown (COMMIT may have been applied
        with its answer lost); the publishes are nacked either way, and a batch
        applied again skips what it holds (``idempotent``).
        """
        if not self._commit_timeout:
            await self._commit(batch, idempotent=idempotent)
            return
        used: list[psycopg.AsyncConnection[Any]] = []
        task = asyncio.ensure_future(self._commit(batch, idempotent=idempotent, used=used))
        try:
            done, _ = await asyncio.wait({task}, timeout=self._commit_timeout)
            if not done:
                # A process resumed after a pause (SIGSTOP, a VM freeze) finds its timer overdue
                # before it has read the answers that came meanwhile: a few more loop turns for
                # them, so a commit the server finished is not nacked (a frozen-loop test of
                # 0.7 s against a 0.5 s timeout gave up on 11 of 48 commits without this, 0 with it).
                done, _ = await asyncio.wait({task}, timeout=0.1)
        except asyncio.CancelledError:
            _abandon(task)
            task.cancel()
            raise
        if done:
            task.result()
            return
        # Held until it ends: the loop keeps only weak references to tasks, and a pending one
        # collected inside the pool's context manager never gives its connection back (bench.chaos
        # logged "Task was destroyed but it is pending!" and "aclose(): asynchronous generator is
        # already running" a few seconds after timeouts). Its failure is the timeout's, reported below.
        _abandon(task)
        for conn in used:  # empty once the transaction is over: a finished commit's connection is left alone
            _shut_down(conn)
        if not used:  # still waiting for a pooled connection: nothing to break, cancel it
            task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)  # ends at once on a shut connection
        if not done:
            task.cancel()
        raise StoreError(f"{self.description}: commit did not finish within {self._commit_timeout:g}s; "
                         "its connection was dropped (the server may or may not have applied it)")

    async def _commit(self, batch: Batch, *, idempotent: bool,
                      used: list[psycopg.AsyncConnection[Any]] | None = None) -> None:
        try:
            await self._commit_in(batch, idempotent, used)
        finally:
            if used is not None:
                used.clear()  # the connection is back in the pool: no longer this commit's to break

    async def _commit_in(self, batch: Batch, idempotent: bool,
                         used: list[psycopg.AsyncConnection[Any]] | None) -> None:
        async with self._connection() as conn, conn.transaction():
            if used is not None:
                used.append(conn)
            cur = conn.cursor()
            for sql, rows in _topology_statements(batch.topology):
                await cur.executemany(sql, rows)
            claimed: dict[tuple[str, str], int] = {}
            if batch.claims:
                vhosts, queues = _columns(list(dict.fromkeys(batch.claims)), 2)
                await cur.execute(
                    "INSERT INTO queue_epochs (vhost, queue, epoch) SELECT v, q, 1 FROM unnest(%s::text[], %s::text[])"
                    " AS u(v, q) ON CONFLICT (vhost, queue) DO UPDATE SET epoch = queue_epochs.epoch + 1"
                    " RETURNING vhost, queue, epoch",
                    (vhosts, queues),
                )
                claimed = {(v, q): int(e) for v, q, e in await cur.fetchall()}
            await self._check_epochs(cur, {k: e for k, e in batch.epochs.items() if k not in claimed})
            if batch.purges:
                vhosts, queues = _columns(sorted(set(batch.purges)), 2)
                await cur.execute(
                    "DELETE FROM messages WHERE (vhost, queue) IN (SELECT * FROM unnest(%s::text[], %s::text[]))",
                    (vhosts, queues),
                )
            if batch.appends:
                await self._append(cur, batch.appends, idempotent)
            if batch.delivery_counts:
                latest = {(v, q, o): n for v, q, o, n in batch.delivery_counts}
                vhosts, queues, offsets, counts = _columns([(*k, n) for k, n in sorted(latest.items())], 4)
                await cur.execute(
                    "UPDATE messages m SET delivery_count = u.n"
                    " FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::integer[]) AS u(vhost, queue, off, n)"
                    ' WHERE m.vhost = u.vhost AND m.queue = u.queue AND m."offset" = u.off',
                    (vhosts, queues, offsets, counts),
                )
            if batch.removals:
                vhosts, queues, offsets = _columns(sorted(set(batch.removals)), 3)
                await cur.execute(
                    'DELETE FROM messages WHERE (vhost, queue, "offset") IN'
                    " (SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[]))",
                    (vhosts, queues, offsets),
                )
            if batch.truncations:
                # One range delete per stream: the highest first-kept offset of the batch.
                keep: dict[tuple[str, str], int] = {}
                for v, q, first in batch.truncations:
                    keep[(v, q)] = max(first, keep.get((v, q), first))
                vhosts, queues, offsets = _columns([(*k, o) for k, o in sorted(keep.items())], 3)
                await cur.execute(
                    "DELETE FROM messages m USING unnest(%s::text[], %s::text[], %s::bigint[]) AS t(vhost, queue, off)"
                    ' WHERE m.vhost = t.vhost AND m.queue = t.queue AND m."offset" < t.off',
                    (vhosts, queues, offsets),
                )
            if batch.offsets:
                vhosts, queues, groups, offsets = _columns([(*k, o) for k, o in sorted(batch.offsets.items())], 4)
                await cur.execute(
                    'INSERT INTO stream_offsets (vhost, queue, grp, "offset")'
                    " SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[])"
                    ' ON CONFLICT (vhost, queue, grp) DO UPDATE SET "offset" = EXCLUDED."offset"',
                    (vhosts, queues, groups, offsets),
                )
        batch.claimed = claimed  # the transaction committed

    async def load_range(self, vhost: str, queue: str, start: int, below: int | None, limit: int
                         ) -> list[StoredMessage]:
        with self._guard(f"reading the messages of {vhost}/{queue} from offset {start}"):
            async with self._connection() as conn:
                cur = conn.cursor(binary=True)
                await cur.execute(
                    'SELECT "offset", message_id, exchange, routing_key, properties, body, enqueued_at, expires_at,'
                    " delivery_count FROM messages WHERE vhost = %s AND queue = %s AND \"offset\" >= %s"
                    " AND \"offset\" < %s AND state = 'ready' ORDER BY \"offset\" LIMIT %s",
                    (vhost, queue, start, below if below is not None else 2**63 - 1, limit),
                )
                rows = await cur.fetchall()
        return [StoredMessage(vhost, queue, *row) for row in rows]

    async def load_offsets(self, vhost: str, queue: str) -> dict[str, int]:
        with self._guard(f"loading the group offsets of {vhost}/{queue}"):
            async with self._connection() as conn:
                cur = await conn.execute(
                    'SELECT grp, "offset" FROM stream_offsets WHERE vhost = %s AND queue = %s', (vhost, queue)
                )
                rows = await cur.fetchall()
        return {str(grp): int(offset) for grp, offset in rows}

    @staticmethod
    async def _check_epochs(cur: psycopg.AsyncCursor[Any], epochs: dict[tuple[str, str], int]) -> None:
        if not epochs:
            return
        vhosts, queues = _columns(sorted(epochs), 2)
        await cur.execute(
            "SELECT vhost, queue, epoch FROM queue_epochs"
            " WHERE (vhost, queue) IN (SELECT * FROM unnest(%s::text[], %s::text[]))"
            " FOR SHARE",
            (vhosts, queues),
        )
        stored = {(vhost, queue): epoch for vhost, queue, epoch in await cur.fetchall()}
        fenced = [key for key, epoch in epochs.items() if stored.get(key) != epoch]
        if fenced:
            raise Fenced(fenced)  # leaving the transaction block rolls everything back

    @staticmethod
    async def _append(cur: psycopg.AsyncCursor[Any], messages: Sequence[StoredMessage], idempotent: bool) -> None:
        table = "messages"
        if idempotent:
            table = "leveret_staging"
            await cur.execute(
                "CREATE TEMPORARY TABLE leveret_staging (LIKE messages INCLUDING DEFAULTS) ON COMMIT DROP"
            )
        async with cur.copy(f"COPY {table} ({_MESSAGE_COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(_COPY_TYPES)
            for m in messages:
                await copy.write_row(
                    (m.vhost, m.queue, m.offset, m.message_id, m.exchange, m.routing_key, m.properties, m.body,
                     m.enqueued_at, m.expires_at, len(m.body), m.delivery_count)
                )  # fmt: skip
        if idempotent:
            await cur.execute(
                f"INSERT INTO messages ({_MESSAGE_COLUMNS}) SELECT {_MESSAGE_COLUMNS} FROM leveret_staging"
                " ON CONFLICT DO NOTHING"
            )


# A batch whose appends carry at least this many body bytes is split over
# several connections (at most one part per SPLIT_PART_BYTES, at most the pool).
SPLIT_MIN_BYTES = 2 * 1024 * 1024
SPLIT_PART_BYTES = 1024 * 1024


def _shut_down(conn: psycopg.AsyncConnection[Any]) -> None:
    """Shut the connection's socket down both ways, without closing its fd (see _bounded_commit)."""
    with contextlib.suppress(Exception):  # already closed or broken: nothing left to break
        sock = socket.fromfd(conn.pgconn.socket, socket.AF_INET, socket.SOCK_STREAM)  # a dup of the fd
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()  # the dup only


# Commits given up on by the timeout, until they end (see PostgresStore._bounded_commit).
_ABANDONED: set[asyncio.Future[None]] = set()


def _abandon(task: asyncio.Future[None]) -> None:
    _ABANDONED.add(task)
    task.add_done_callback(_settle)


def _settle(task: asyncio.Future[None]) -> None:
    _ABANDONED.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: the commit's failure was reported as the timeout


def _split(batch: Batch, connections: int) -> list[Batch]:
    """Parts of ``batch`` to commit in parallel: the first carries every purge, removal and
    delivery count, the appends are dealt out by size. A single part when small."""
    total = sum(len(m.body) for m in batch.appends)
    parts = min(connections, len(batch.appends), total // SPLIT_PART_BYTES)
    # Purges stay with their appends: a purge in one part, run after another
    # part committed, would delete messages published after it.
    # Topology and claims come before the epoch check of every part: one transaction.
    if total < SPLIT_MIN_BYTES or parts < 2 or batch.purges or batch.topology or batch.claims:
        return [batch]
    appends = list(batch.appends)
    # A delivery count for a message appended in this batch goes into the
    # appended row: an UPDATE in one part cannot see a row another part inserts.
    counts = list(batch.delivery_counts)
    if counts:
        index = {(m.vhost, m.queue, m.offset): i for i, m in enumerate(appends)}
        rest = []
        for v, q, o, n in counts:
            i = index.get((v, q, o))
            if i is None:
                rest.append((v, q, o, n))
            else:
                appends[i] = dataclasses.replace(appends[i], delivery_count=n)
        counts = rest
    out = [Batch(epochs=dict(batch.epochs)) for _ in range(parts)]
    out[0].removals = list(batch.removals)
    out[0].delivery_counts = counts
    loads = [0] * parts
    for m in appends:  # largest bodies are the usual case; greedy keeps parts even
        i = loads.index(min(loads))
        out[i].appends.append(m)
        loads[i] += len(m.body)
    for part in out:  # offsets in order within each part, as COPY wrote them before
        part.appends.sort(key=lambda m: (m.vhost, m.queue, m.offset))
    return out


def _require_epochs(batch: Batch) -> None:
    """Every write must name a queue whose epoch the batch carries (else it would bypass fencing)."""
    touched = {(m.vhost, m.queue) for m in batch.appends}
    touched.update((v, q) for v, q, _ in batch.removals)
    touched.update((v, q) for v, q, _, _ in batch.delivery_counts)
    touched.update(batch.purges)
    touched.update((v, q) for v, q, _ in batch.truncations)
    touched.update((v, q) for v, q, _ in batch.offsets)
    missing = touched.difference(batch.epochs, batch.claims)
    if missing:
        names = ", ".join(f"{v}/{q}" for v, q in sorted(missing))
        raise ValueError(f"batch writes to queue(s) without an epoch: {names}")


_SAVE_EXCHANGE = (
    "INSERT INTO exchanges (vhost, name, type, auto_delete, internal, arguments) VALUES (%s, %s, %s, %s, %s, %s)"
    " ON CONFLICT (vhost, name) DO UPDATE SET type = EXCLUDED.type, auto_delete = EXCLUDED.auto_delete,"
    " internal = EXCLUDED.internal, arguments = EXCLUDED.arguments"
)
_SAVE_QUEUE = (
    "INSERT INTO queues (vhost, name, auto_delete, arguments) VALUES (%s, %s, %s, %s)"
    " ON CONFLICT (vhost, name) DO UPDATE SET auto_delete = EXCLUDED.auto_delete, arguments = EXCLUDED.arguments"
)
_SAVE_BINDING = (
    "INSERT INTO bindings (vhost, source, destination_kind, destination, routing_key, arguments, arguments_key)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
    " ON CONFLICT (vhost, source, destination_kind, destination, routing_key, arguments_key)"
    " DO UPDATE SET arguments = EXCLUDED.arguments"
)
_DELETE_BINDING = (
    "DELETE FROM bindings WHERE vhost = %s AND source = %s AND destination_kind = %s AND destination = %s"
    " AND routing_key = %s AND arguments_key = %s"
)
# A deleted exchange or queue: each statement gets (vhost, name).
_DELETE_EXCHANGE = (
    "DELETE FROM bindings WHERE vhost = %s AND (source = %s OR (destination_kind = 'exchange' AND destination = %s))",
    "DELETE FROM exchanges WHERE vhost = %s AND name = %s",
)
_DELETE_QUEUE = (
    "DELETE FROM queue_epochs WHERE vhost = %s AND queue = %s",
    "DELETE FROM messages WHERE vhost = %s AND queue = %s",
    "DELETE FROM stream_offsets WHERE vhost = %s AND queue = %s",
    "DELETE FROM bindings WHERE vhost = %s AND destination_kind = 'queue' AND destination = %s",
    "DELETE FROM queues WHERE vhost = %s AND name = %s",
)


def _topology_statements(writes: Sequence[TopologyWrite]) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """(statement, rows) in the order of ``writes``: consecutive writes of one kind share an executemany
    (pipelined by psycopg), so a burst of declarations costs a few round trips, not one each."""
    out: list[tuple[str, list[tuple[Any, ...]]]] = []

    def add(sql: str, row: tuple[Any, ...]) -> None:
        if out and out[-1][0] == sql:
            out[-1][1].append(row)
        else:
            out.append((sql, [row]))

    for w in writes:
        r = w.record
        if isinstance(r, ExchangeRecord):
            if w.delete:
                add(_DELETE_EXCHANGE[0], (r.vhost, r.name, r.name))
                add(_DELETE_EXCHANGE[1], (r.vhost, r.name))
            else:
                add(_SAVE_EXCHANGE, (r.vhost, r.name, r.type, r.auto_delete, r.internal,
                                     _encode_arguments(r.arguments)))
        elif isinstance(r, QueueRecord):
            if w.delete:
                for sql in _DELETE_QUEUE:
                    add(sql, (r.vhost, r.name))
            else:
                add(_SAVE_QUEUE, (r.vhost, r.name, r.auto_delete, _encode_arguments(r.arguments)))
        elif w.delete:
            add(_DELETE_BINDING, (r.vhost, r.source, r.destination_kind, r.destination, r.routing_key,
                                  binding_arguments_key(r.arguments)))
        else:
            add(_SAVE_BINDING, (r.vhost, r.source, r.destination_kind, r.destination, r.routing_key,
                                _encode_arguments(r.arguments), binding_arguments_key(r.arguments)))
    return out


def _columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows to ``width`` column lists (the arrays unnest() takes)."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(col) for col in zip(*rows, strict=True)]
