"""LMTP transports: a WebSocket at /lmtp (one or more lines per text frame) and, optionally, plain
TCP with one message per line."""

from __future__ import annotations

import asyncio
import json
import logging
import weakref

from aiohttp import WSMsgType, web

from backends.mlx.serve.lmtp_session import LmtpSession
from backends.mlx.serve.service import Service

log = logging.getLogger("etmlx.serve")


class LmtpRoutes:
    def __init__(self, service: Service):
        self.service = service
        self.sockets: weakref.WeakSet = weakref.WeakSet()

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/lmtp", self.websocket)

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        self.sockets.add(ws)
        session = LmtpSession(self.service, ws.send_str)
        try:
            async for message in ws:
                if message.type == WSMsgType.TEXT:
                    for line in message.data.splitlines():
                        await session.handle_line(line)
                # A text frame that is not UTF-8 never gets here: aiohttp fails the connection with
                # close code 1007 (invalid payload data), as RFC 6455 requires; other sockets go on.
                elif message.type == WSMsgType.BINARY:
                    await ws.send_str('MSG {"stream_id": null, "error": "LMTP frames are text"}')
                elif message.type == WSMsgType.ERROR:
                    break
        finally:
            await session.close()
        return ws

    async def close_all(self) -> None:
        for ws in list(self.sockets):
            await ws.close(message=b"server shutting down")


def json_line(kind: str, payload: dict) -> str:
    return kind + " " + json.dumps(payload)


MAX_LINE = 4 * 1024 * 1024  # bytes of one LMTP line over TCP
DRAIN_SECONDS = 2.0


async def _half_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """End our side (FIN) and read what the client still sends for a moment: closing with unread input
    would reset the connection, and the client could lose the error line sent just before."""
    writer.write_eof()
    loop = asyncio.get_running_loop()
    end = loop.time() + DRAIN_SECONDS
    while loop.time() < end:
        try:
            if not await asyncio.wait_for(reader.read(1 << 16), timeout=end - loop.time()):
                return
        except asyncio.TimeoutError:
            return


async def serve_lmtp_lines(service: Service, host: str, port: int):
    """LMTP over plain TCP, one message per line (at most MAX_LINE bytes: a longer one is answered with an
    error MSG and the connection closes, since the rest of that line cannot be told from the next)."""
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send(line: str) -> None:
            writer.write(line.encode() + b"\n")
            await writer.drain()

        session = LmtpSession(service, send)
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # asyncio's limit: the line is longer than MAX_LINE (a client's mistake)
                    await asyncio.wait_for(send(json_line("MSG", {
                        "stream_id": None, "error": f"line longer than the limit of {MAX_LINE} bytes; closing "
                                                    "the connection"})), timeout=5.0)
                    await _half_close(reader, writer)
                    break
                if not line:
                    break
                try:
                    text = line.decode()
                except UnicodeDecodeError as exc:
                    await send(json_line("MSG", {"stream_id": None,
                                                 "error": f"malformed line: not valid UTF-8 (byte {exc.start})"}))
                    continue
                await session.handle_line(text)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            await session.close()
            writer.close()

    return await asyncio.start_server(connection, host, port, limit=MAX_LINE)
