"""The management HTTP API (RabbitMQ's paths and JSON) on --management-port, with aiohttp.

Every request is authenticated with HTTP basic auth against the broker's
users; the user's tags decide what it may do (routing.ACCESS). Handlers raise
``HttpError`` for a refusal; an engine error (404 not found, 406 inequivalent,
403 refused) becomes the matching HTTP status with RabbitMQ's body. The
engine is only touched from the event loop, as the AMQP front end does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import ssl
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from core.engine.access import Grants
from core.engine.broker import User
from core.engine.vhost import VirtualHost
from core.model.errors import AccessRefused, BrokerError, NotFound, ResourceLocked
from leveret.http import (
    api_admin,
    api_backup,
    api_conns,
    api_federation,
    api_limits,
    api_operator,
    api_retention,
    api_shovels,
    api_topology,
    console,
    definitions,
)
from leveret.http.context import NodeView
from leveret.http.errors import HttpError, bad_request, not_authorised, not_found
from leveret.http.rates import RateSampler
from leveret.http.responses import json_response
from leveret.http.routing import Router

log = logging.getLogger("leveret.http")

REALM = 'Basic realm="RabbitMQ Management"'
MAX_BODY = 64 * 1024 * 1024  # a definitions file of many thousands of objects fits


class Call:
    """One authenticated request: its user, path parameters, query and body."""

    def __init__(self, api: ManagementAPI, request: web.Request, user: User, params: dict[str, str]) -> None:
        self.api = api
        self.node = api.node
        self.broker = api.node.broker
        self.request = request
        self.user = user
        self.params = params
        self.query: Mapping[str, str] = request.query

    @property
    def node_name(self) -> str:
        return self.broker.node_id

    def has(self, *tags: str) -> bool:
        return any(t in self.user.tags for t in tags)

    @property
    def sees_all(self) -> bool:
        """Monitoring users and administrators see every vhost, connection and channel."""
        return self.has("administrator", "monitoring")

    def visible_vhosts(self) -> list[VirtualHost]:
        if self.sees_all:
            return list(self.broker.vhosts.values())
        return [vh for name, vh in self.broker.vhosts.items() if name in self.user.vhosts]

    def vhost(self, name: str | None = None, write: bool = False) -> VirtualHost:
        """The vhost of the path (``{vhost}``): 404 when missing, 401 when this user may not use it."""
        name = self.params["vhost"] if name is None else name
        vh = self.broker.vhosts.get(name)
        if vh is None:
            raise not_found(f"vhost '{name}' not found")
        allowed = name in self.user.vhosts or self.has("administrator") or (not write and self.sees_all)
        if not allowed:
            raise not_authorised(f"access to vhost '{name}' refused for user '{self.user.name}'")
        return vh

    def grants(self, vh: VirtualHost) -> Grants:
        """This user's permission answers in ``vh``: the management API checks what AMQP checks."""
        return self.broker.access.grants(self.user.name, vh.name)

    async def body(self, allowed: frozenset[str] | None = None) -> dict[str, Any]:
        """The JSON object sent; 400 for malformed JSON, a non-object, or a field not in ``allowed``."""
        raw = await self.request.read()
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"malformed JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        if allowed is not None:
            unknown = sorted(set(data) - allowed)
            if unknown:
                raise bad_request(f"unknown field(s): {', '.join(unknown)}")
        return data


# Methods that change state. A browser sends these cross-origin without asking first (no CORS
# preflight) only with a form's content types (text/plain, urlencoded, multipart): refusing every
# content type but JSON is what keeps another site's page from driving the API with the console
# user's remembered credentials (CSRF).
_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _json_only(request: web.Request) -> None:
    """415 for a state-changing request with a body (or a declared type) that is not application/json."""
    if request.method not in _CHANGING:
        return
    declared = request.headers.get("Content-Type")
    if declared is None and not request.body_exists:
        return  # `curl -X DELETE`: nothing to decode, nothing a form could have sent
    if request.content_type != "application/json":
        raise HttpError(415, "unsupported_media_type",
                        f"a {request.method} request's body must be JSON sent as Content-Type: application/json "
                        f"(got {declared or 'none'})")


class ManagementAPI:
    def __init__(self, node: NodeView) -> None:
        self.node = node
        self.started_at = time.time()
        self.rates = RateSampler(node.broker, amqp=node.amqp)
        self.router = Router()
        for module in (api_admin, api_backup, api_conns, api_limits, api_topology, api_retention, api_shovels,
                       api_federation, definitions, api_operator):
            module.register(self.router)
        self.app = web.Application(client_max_size=MAX_BODY)
        console.register(self.app)
        api_operator.register_app(self.app, self)  # /cli/rabbitmqadmin, the console's samples
        self.app.router.add_route("*", "/api/{tail:.*}", self._dispatch)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.port = 0
        self._logins: dict[tuple[str, bytes, str | None], User] = {}

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on ``host:port``; HTTPS only when ``ssl_context`` is given (--http-tls)."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port, reuse_address=True, ssl_context=ssl_context)
        await self._site.start()
        addresses = self._runner.addresses
        self.port = int(addresses[0][1]) if addresses else port
        self.rates.start()
        log.info("management API listening", extra={"host": host, "port": self.port, "tls": ssl_context is not None})

    async def stop(self) -> None:
        await self.rates.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _authenticate(self, request: web.Request) -> User:
        header = request.headers.get("Authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic" or not encoded:
            raise not_authorised("Login failed")
        try:
            username, sep, password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise not_authorised("Login failed") from None
        if not sep:
            raise not_authorised("Login failed")
        # Tools and the console send the same credentials on every request: a login that
        # succeeded is remembered (as the gRPC API does) while the user object stays the same.
        key = (username, hashlib.sha256(password.encode()).digest(), request.remote)
        user = self._logins.get(key)
        if user is None or self.node.broker.users.get(username) is not user:
            try:
                # The login throttle's turn and delay, the KDF off the event loop (Broker.login).
                user = await self.node.broker.login(username, password, request.remote)
            except AccessRefused:
                raise not_authorised("Login failed") from None
            if len(self._logins) > 1024:
                self._logins.clear()
            self._logins[key] = user
        if not any(t in user.tags for t in ("administrator", "monitoring", "policymaker", "management")):
            raise not_authorised("Not management user")
        return user

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        raw_path = request.raw_path.split("?", 1)[0]
        try:
            found = self.router.match(raw_path[len("/api"):])
            if found is None:
                raise not_found()
            route, params = found
            method = "GET" if request.method == "HEAD" else request.method
            if method not in route.methods:
                raise HttpError(405, "Method Not Allowed", f"{request.method} is not allowed here")
            handler, access = route.methods[method]
            _json_only(request)
            user = await self._authenticate(request)
            if access == "administrator" and "administrator" not in user.tags:
                raise not_authorised("Not administrator user")
            if access == "monitoring" and not any(t in user.tags for t in ("administrator", "monitoring")):
                raise not_authorised("Not monitor user")
            if access == "policymaker" and not any(t in user.tags for t in ("administrator", "policymaker")):
                raise not_authorised("Not policymaker user")
            result = await handler(Call(self, request, user, params))
        except HttpError as exc:
            return self._error(request, exc)
        except NotFound as exc:
            return self._error(request, not_found(exc.text))
        except AccessRefused as exc:
            return self._error(request, HttpError(403, "access_refused", exc.text))
        except ResourceLocked as exc:  # another connection's exclusive queue: RabbitMQ's AMQP text, as 400
            return self._error(request, bad_request(f"405 {exc.reply_text}"))
        except BrokerError as exc:
            return self._error(request, bad_request(exc.text))
        except web.HTTPException:
            raise  # aiohttp's own answers (413 for a body over MAX_BODY)
        except Exception:
            # A bug here: one log record with its traceback, and RabbitMQ's error shape for the caller.
            log.exception("management API request failed", extra={"method": request.method, "path": request.path})
            return json_response({"error": "internal_error", "reason": "the request failed; see the node's log"},
                                 status=500)
        if isinstance(result, web.StreamResponse):
            return result
        return json_response(result)

    def _error(self, request: web.Request, exc: HttpError) -> web.Response:
        if exc.status >= 400 and exc.status != 404:
            log.info("management API refused a request", extra={
                "method": request.method, "path": request.path, "status": exc.status, "reason": exc.reason})
        response = json_response(exc.body(), status=exc.status)
        if exc.status == 401 and request.headers.get("X-Requested-With") != "XMLHttpRequest":
            # Not for the console's own requests: the header makes a browser open its login dialog.
            response.headers["WWW-Authenticate"] = REALM
        return response
