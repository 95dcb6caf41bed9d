"""Thin wrappers for the AMQP control operations the scenarios use."""

from __future__ import annotations

import secrets

from pamqp import commands

from bench.connection import AmqpError, Connection


def unique_name(scenario: str, suffix: str = "") -> str:
    """``bench.<scenario>.<random>[.suffix]``: never collides with a previous or parallel run."""
    name = f"bench.{scenario}.{secrets.token_hex(4)}"
    return f"{name}.{suffix}" if suffix else name


async def open_channel(conn: Connection, channel: int = 1) -> int:
    await conn.rpc(channel, commands.Channel.Open())
    return channel


async def declare_queue(
    conn: Connection, channel: int, name: str, *, durable: bool = False, auto_delete: bool = False
) -> None:
    await conn.rpc(channel, commands.Queue.Declare(queue=name, durable=durable, auto_delete=auto_delete))


async def declare_exchange(conn: Connection, channel: int, name: str, kind: str) -> None:
    await conn.rpc(channel, commands.Exchange.Declare(exchange=name, exchange_type=kind))


async def bind_queue(conn: Connection, channel: int, queue: str, exchange: str, routing_key: str) -> None:
    await conn.rpc(channel, commands.Queue.Bind(queue=queue, exchange=exchange, routing_key=routing_key))


async def qos(conn: Connection, channel: int, prefetch: int) -> None:
    await conn.rpc(channel, commands.Basic.Qos(prefetch_count=prefetch))


async def consume(conn: Connection, channel: int, queue: str, *, ack_every: int) -> None:
    """Start a consumer; the connection acks with multiple=true every ``ack_every`` (0: no-ack mode)."""
    conn.ack_every = ack_every
    conn.ack_channel = channel
    await conn.rpc(channel, commands.Basic.Consume(queue=queue, consumer_tag=f"bench-{queue}", no_ack=ack_every == 0))


async def confirm_select(conn: Connection, channel: int) -> None:
    await conn.rpc(channel, commands.Confirm.Select())


async def cleanup(conn: Connection, *, queues: list[str], exchanges: list[str]) -> list[str]:
    """Delete what a scenario declared; return problems instead of raising.

    Each delete gets its own channel: a broker may answer a delete of an
    already auto-deleted entity with a channel close (404), which must not
    stop the remaining deletes.
    """
    problems: list[str] = []
    channel = 100
    for kind, names in (("exchange", exchanges), ("queue", queues)):
        for name in names:
            channel += 1
            try:
                await open_channel(conn, channel)
                method = (
                    commands.Exchange.Delete(exchange=name) if kind == "exchange" else commands.Queue.Delete(queue=name)
                )
                await conn.rpc(channel, method)
            except AmqpError as exc:
                if "404" not in str(exc):
                    problems.append(f"delete {kind} {name}: {exc}")
                if not conn.is_open:
                    return problems
    return problems
