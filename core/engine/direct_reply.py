"""Direct reply-to (``amq.rabbitmq.reply-to``): RPC replies without a reply queue.

A requester consumes (no-ack) from the pseudo-queue ``amq.rabbitmq.reply-to``
on a channel; its requests' ``reply_to`` is rewritten to
``amq.rabbitmq.reply-to.<token>``; a reply published to the default exchange
with that routing key goes straight to the requester's consumer, or nowhere
once it is gone.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable

from core.model.message import Message

PSEUDO_QUEUE = "amq.rabbitmq.reply-to"
PREFIX = PSEUDO_QUEUE + "."


def node_tag(node_id: str) -> str:
    """A node id as it appears at the end of reply tokens (no dots, URL-safe)."""
    return base64.urlsafe_b64encode(node_id.encode()).decode().rstrip("=")


class ReplyRegistry:
    def __init__(self) -> None:
        self._receivers: dict[str, Callable[[Message], None]] = {}
        # Cluster mode: tokens end with ".<node tag>" so a reply published on
        # another node can be sent to the requester's node (``remote``).
        self.tag = ""
        self.remote: Callable[[str, str, Message], bool] | None = None

    def register(self, receiver: Callable[[Message], None]) -> str:
        token = base64.urlsafe_b64encode(os.urandom(18)).decode()
        if self.tag:
            token += "." + self.tag
        self._receivers[token] = receiver
        return token

    def _elsewhere(self, token: str) -> str | None:
        """The node tag of a token issued by another node of the cluster, else None."""
        if self.remote is None or "." not in token:
            return None
        tag = token.rsplit(".", 1)[1]
        return tag if tag != self.tag else None

    def unregister(self, token: str) -> None:
        self._receivers.pop(token, None)

    def is_live(self, address: str) -> bool:
        token = address[len(PREFIX):]
        # Another node's requester: assume live (asking would cost a round trip per check).
        return token in self._receivers or self._elsewhere(token) is not None

    def deliver(self, routing_key: str, message: Message) -> bool:
        """True when the reply address is live (the message went to its consumer, or to its node)."""
        token = routing_key[len(PREFIX):]
        receiver = self._receivers.get(token)
        if receiver is None:
            tag = self._elsewhere(token)
            if tag is not None and self.remote is not None:
                return self.remote(tag, routing_key, message)
            return False
        receiver(message)
        return True
