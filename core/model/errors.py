"""Errors the core raises, each carrying the AMQP reply code that names it.

The codes are AMQP 0-9-1's because they are also a good generic vocabulary
(the gRPC front end maps them onto status codes); the core itself never
decides whether an error closes a channel or a connection, the front end does.
"""

from __future__ import annotations


class BrokerError(Exception):
    """A refusal a client can act on: ``code`` plus a readable ``text``."""

    code = 541
    name = "INTERNAL_ERROR"

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    @property
    def reply_text(self) -> str:
        return f"{self.name} - {self.text}"


class NotFound(BrokerError):
    code = 404
    name = "NOT_FOUND"


class NotOwner(NotFound):
    """The queue's owner cannot be reached (RabbitMQ: 404, "home node ... is down or inaccessible")."""


class AccessRefused(BrokerError):
    code = 403
    name = "ACCESS_REFUSED"


class ResourceLocked(BrokerError):
    code = 405
    name = "RESOURCE_LOCKED"


class PreconditionFailed(BrokerError):
    code = 406
    name = "PRECONDITION_FAILED"


class FrameError(BrokerError):
    code = 501
    name = "FRAME_ERROR"


class SyntaxError_(BrokerError):
    code = 502
    name = "SYNTAX_ERROR"


class CommandInvalid(BrokerError):
    code = 503
    name = "COMMAND_INVALID"


class ChannelError(BrokerError):
    code = 504
    name = "CHANNEL_ERROR"


class UnexpectedFrame(BrokerError):
    code = 505
    name = "UNEXPECTED_FRAME"


class ResourceError(BrokerError):
    code = 506
    name = "RESOURCE_ERROR"


class NotAllowed(BrokerError):
    code = 530
    name = "NOT_ALLOWED"


class NotImplementedFeature(BrokerError):
    code = 540
    name = "NOT_IMPLEMENTED"


class InternalError(BrokerError):
    code = 541
    name = "INTERNAL_ERROR"
