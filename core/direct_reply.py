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

from core.message import Message

PSEUDO_QUEUE = "amq.rabbitmq.reply-to"
PREFIX = PSEUDO_QUEUE + "."


class ReplyRegistry:
    def __init__(self) -> None:
        self._receivers: dict[str, Callable[[Message], None]] = {}

    def register(self, receiver: Callable[[Message], None]) -> str:
        token = base64.urlsafe_b64encode(os.urandom(18)).decode()
        self._receivers[token] = receiver
        return token

    def unregister(self, token: str) -> None:
        self._receivers.pop(token, None)

    def is_live(self, address: str) -> bool:
        return address[len(PREFIX):] in self._receivers

    def deliver(self, routing_key: str, message: Message) -> bool:
        """True when the reply address is live (the message went to its consumer)."""
        receiver = self._receivers.get(routing_key[len(PREFIX):])
        if receiver is None:
            return False
        receiver(message)
        return True
