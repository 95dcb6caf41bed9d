"""MQTT over WebSocket (RabbitMQ's Web-MQTT): binary frames at ``/ws`` carry the same bytes as TCP."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING

from aiohttp import WSMsgType, web

from mqtt_frontend.connection import MqttConnection
from mqtt_frontend.server import Link

if TYPE_CHECKING:
    from mqtt_frontend.server import MQTTServer

log = logging.getLogger("leveret.mqtt")


class WebSocketListener:
    def __init__(self, server: MQTTServer, path: str = "/ws") -> None:
        self.server = server
        self.path = path
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int, context: ssl.SSLContext | None = None) -> None:
        self.server.sessions.watch_holds()  # as the TCP listener does (also when it is the only one)
        app = web.Application()
        app.router.add_get(self.path, self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=context, reuse_address=True)
        await site.start()
        server = site._server
        self.port = int(server.sockets[0].getsockname()[1]) if server is not None else port  # type: ignore[attr-defined]
        log.info("mqtt over websocket listening", extra={"host": host, "port": self.port, "path": self.path})

    async def _handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=("mqtt", "mqttv3.1"), max_msg_size=self.server.settings.max_packet_size)
        await ws.prepare(request)
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        conn = MqttConnection(self.server.broker, self.server.sessions, self.server.settings,
                              peer=(peer[0], peer[1]) if peer else None)
        outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        reading = asyncio.Event()
        reading.set()

        def set_reading(on: bool) -> None:
            if on:
                reading.set()
            else:
                reading.clear()

        tr = request.transport
        local = tr.get_extra_info("sockname") if tr is not None else None
        link = Link(self.server, conn, outbox.put_nowait, lambda: outbox.put_nowait(None), set_reading,
                    local=(local[0], local[1]) if local else None,
                    tls=tr is not None and tr.get_extra_info("ssl_object") is not None, transport="websocket")

        async def writer() -> None:
            while (data := await outbox.get()) is not None:
                await ws.send_bytes(data)
            await ws.close()

        write_task = asyncio.create_task(writer())
        try:
            async for msg in ws:
                if msg.type == WSMsgType.BINARY:
                    link.received(msg.data)
                    await reading.wait()  # held by flow control or the memory alarm
                elif msg.type in (WSMsgType.TEXT,):
                    conn.close(0x81, "MQTT over WebSocket takes binary frames only")
                    link.flush()
                    break
        finally:
            link.lost()
            outbox.put_nowait(None)
            await asyncio.gather(write_task, return_exceptions=True)
        return ws

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
