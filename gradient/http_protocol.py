"""uvicorn's HTTP protocol with a request time-out: a connection must complete its request's headers
within GRADIENT_HTTP_REQUEST_TIMEOUT_SECS of opening (or of starting its next request), or it is
closed. uvicorn times out an idle keep-alive connection after a response (5 s), but never one that has
sent nothing yet, or half a request: such connections would stay open for ever, each holding a file
descriptor (a few hundred made /healthz unreachable under a lowered limit). A WebSocket's upgrade is a
request like another; after it, the /proto handshake time-out applies (workers.proto.consumer).

The WebSocket protocol is uvicorn's too (websockets' sans-I/O implementation), with a text frame that
is no UTF-8 logged as one INFO line instead of an ERROR with its traceback (StrictTextWebSocketProtocol).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger("gradient.http")


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (uvicorn[standard]) with the request time-out."""

    _request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:  # the first bytes of a request, the first or a next one
        self._arm()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._request_timer = self.loop.call_later(
            settings.GRADIENT_HTTP_REQUEST_TIMEOUT_SECS, self._request_timed_out
        )

    def _disarm(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _request_timed_out(self) -> None:
        self._request_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class StrictTextWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (websockets' sans-I/O), with a text frame that is no UTF-8 closed
    with 1007 as before but logged as one INFO line: uvicorn logs it at ERROR with a traceback, so any
    client could fill the log with them. (A server's own failure still logs its traceback.)"""

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type != "text" or self.close_sent:
            super().send_receive_event_to_app()
            return
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            client = self.client
            log.info(
                "closed a /proto socket of %s with 1007: a text frame is no UTF-8 (%s)",
                f"{client[0]}:{client[1]}" if client else "a client",
                exc.reason,
            )
            self.conn.send_close(1007)
            self.handle_parser_exception()
            return
        self.queue.put_nowait({"type": "websocket.receive", "text": text})
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
