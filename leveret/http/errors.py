"""HTTP errors with RabbitMQ's body: ``{"error": ..., "reason": ...}``."""

from __future__ import annotations


class HttpError(Exception):
    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.error = error
        self.reason = reason

    def body(self) -> dict[str, str]:
        return {"error": self.error, "reason": self.reason}


def bad_request(reason: str) -> HttpError:
    return HttpError(400, "bad_request", reason)


def not_found(reason: str = "Not Found") -> HttpError:
    return HttpError(404, "Object Not Found", reason)


def not_authorised(reason: str = "Not management user") -> HttpError:
    return HttpError(401, "not_authorized", reason)  # RabbitMQ spells it so in its bodies
