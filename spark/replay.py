"""Replay archived messages back through a broker (pika, publisher confirms).

Reads the Parquet archive the retention job wrote, keeps one copy of each
(vhost, queue, offset) (a run that crashed between archiving and deleting
leaves a second copy under another run id), orders by offset and publishes
each message to ``--to-exchange`` with its original routing key (or
``--routing-key``), message id and properties, plus the header
``x-replayed-from`` = ``<vhost>/<queue>@<offset>``. Messages go persistent
unless they were published otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.model import properties as amqp_properties

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

REPLAY_HEADER = "x-replayed-from"


def parse_time(text: str | None) -> float | None:
    """Unix seconds from a number or an ISO 8601 date/time (UTC unless it says otherwise)."""
    if text is None or text == "":
        return None
    try:
        return float(text)
    except ValueError:
        pass
    import datetime

    value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    return value.timestamp()


def archived_messages(spark: SparkSession, archive_dir: str, queue: str, vhost: str = "/",
                      since: float | None = None, until: float | None = None) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The archived messages of one queue, once each, in offset order."""
    from pyspark.sql import functions as F

    if not any(Path(archive_dir).glob("vhost=*")):
        return iter(())
    df = spark.read.parquet(archive_dir)
    df = df.where((F.col("vhost_name") == vhost) & (F.col("queue_name") == queue))
    if since is not None:
        df = df.where(F.col("enqueued_at") >= F.lit(since))
    if until is not None:
        df = df.where(F.col("enqueued_at") < F.lit(until))
    df = df.dropDuplicates(["vhost_name", "queue_name", "offset"]).orderBy("offset")
    return (row.asDict() for row in df.toLocalIterator())


def pika_properties(raw: bytes, message_id: str, replayed_from: str) -> Any:
    import pika

    props = amqp_properties.decode(bytes(raw)) if raw else {}
    headers = dict(props.get("headers") or {})
    headers[REPLAY_HEADER] = replayed_from
    # pika cannot encode floats in a header table: send them as strings.
    headers = {k: (str(v) if isinstance(v, float) else v) for k, v in headers.items()}
    return pika.BasicProperties(
        content_type=props.get("content_type"),
        content_encoding=props.get("content_encoding"),
        headers=headers,
        delivery_mode=props.get("delivery_mode") or 2,
        priority=props.get("priority"),
        correlation_id=props.get("correlation_id"),
        reply_to=props.get("reply_to"),
        expiration=props.get("expiration"),
        message_id=props.get("message_id") or message_id,
        timestamp=props.get("timestamp"),
        type=props.get("type"),
        user_id=props.get("user_id"),
        app_id=props.get("app_id"),
        cluster_id=props.get("cluster_id"),
    )


def replay(
    spark: SparkSession,
    archive_dir: str,
    queue: str,
    to_exchange: str,
    *,
    url: str = "amqp://guest:guest@127.0.0.1:5672/",
    vhost: str = "/",
    routing_key: str | None = None,
    since: float | None = None,
    until: float | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> int:
    """Publish the archived messages of ``queue``; returns how many the broker confirmed."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        sent = 0
        last = time.monotonic()
        for m in archived_messages(spark, archive_dir, queue, vhost, since, until):
            origin = f"{m['vhost_name']}/{m['queue_name']}@{m['offset']}"
            channel.basic_publish(
                exchange=to_exchange,
                routing_key=routing_key if routing_key is not None else m["routing_key"],
                body=bytes(m["body"]),
                properties=pika_properties(m["properties"], m["message_id"], origin),
                mandatory=False,
            )  # raises when the broker nacks
            sent += 1
            if time.monotonic() - last > 2:
                progress(f"replayed {sent} message(s)")
                last = time.monotonic()
        progress(f"replayed {sent} message(s) of {vhost}/{queue} to exchange {to_exchange!r}")
        return sent
    finally:
        connection.close()
