"""uvicorn's HTTP protocol with a request time-out: a connection must complete its request's headers
within GRADIENT_HTTP_REQUEST_TIMEOUT_SECS of opening (or of starting its next request), or it is
closed. uvicorn times out an idle keep-alive connection after a response (5 s), but never one that has
sent nothing yet, or half a request: such connections would stay open for ever, each holding a file
descriptor (a few hundred made /healthz unreachable under a lowered limit). A WebSocket's upgrade is a
request like another; after it, the /proto handshake time-out applies (workers.proto.consumer).

Then the whole request, its body too, within GRADIENT_HTTP_BODY_TIMEOUT_SECS of its first byte: a body
sent one byte every few seconds held its connection for ever. And at most
GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS open connections per client address (the peer's; a trusted
proxy's are not capped): one more is answered 503 and closed. A connection upgraded to a WebSocket
leaves this count (the /proto caps are the consumer's). Refusals and time-outs are logged at most once
per address per 10 s, with the count of those left unlogged.

The WebSocket protocol is uvicorn's too (websockets' sans-I/O implementation), with a text frame that
is no UTF-8 logged as one INFO line instead of an ERROR with its traceback (StrictTextWebSocketProtocol).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from gradient.core.lines import LineEvery
from gradient.throttling import is_trusted_proxy

log = logging.getLogger("gradient.http")


# Open HTTP connections of this process per client address (before any upgrade to a WebSocket).
_open_by_address: Counter[str] = Counter()
# Refusals and time-outs: one line per address per this many seconds.
_lines = LineEvery(every_secs=10.0)

REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nretry-after: 5\r\n"
    b"connection: close\r\ncontent-length: 46\r\n\r\nToo many open connections from this address.\r\n"
)


def _log_line(address: str, message: str, *args: Any) -> None:
    unlogged = _lines.due(address, time.monotonic())
    if unlogged is not None:
        log.info(message + " (%d more like it since the last line)", *args, unlogged)


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (uvicorn[standard]) with the request time-outs (headers, then the
    whole request) and the cap on a client address's open connections."""

    _request_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _request_began = 0.0
    _counted: str | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        limit = settings.GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS
        if address and limit > 0 and not is_trusted_proxy(address):
            if _open_by_address[address] >= limit:
                _log_line(
                    address,
                    "refused a connection from %s: %d open already "
                    "(GRADIENT_HTTP_MAX_CONNECTIONS_PER_ADDRESS)",
                    address,
                    _open_by_address[address],
                )
                transport.write(REFUSED)
                transport.close()
                return
            _open_by_address[address] += 1
            self._counted = address
        self._arm()

    def on_message_begin(self) -> None:  # the first bytes of a request, the first or a next one
        self._arm()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if not (self.parser.should_upgrade() and self._should_upgrade()):
            # The rest of the request (its body) within the whole request's time from its first byte.
            self._body_timer = self.loop.call_at(
                self._request_began + settings.GRADIENT_HTTP_BODY_TIMEOUT_SECS, self._body_timed_out
            )

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        # A WebSocket from here on: the /proto handshake time-out and its caps apply, not these.
        self._disarm()
        self._uncount()
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._uncount()
        super().connection_lost(exc)

    def _uncount(self) -> None:
        address, self._counted = self._counted, None
        if address is not None:
            _open_by_address[address] -= 1
            if _open_by_address[address] <= 0:
                del _open_by_address[address]

    def _arm(self) -> None:
        self._disarm()
        self._request_began = self.loop.time()
        self._request_timer = self.loop.call_later(
            settings.GRADIENT_HTTP_REQUEST_TIMEOUT_SECS, self._request_timed_out
        )

    def _disarm(self) -> None:
        for name in ("_request_timer", "_body_timer"):
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

    def _request_timed_out(self) -> None:
        self._request_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            address = self.client[0] if self.client else "a client"
            _log_line(
                address,
                "closed the connection of %s: its request was not complete within %d s "
                "(GRADIENT_HTTP_BODY_TIMEOUT_SECS)",
                address,
                settings.GRADIENT_HTTP_BODY_TIMEOUT_SECS,
            )
            self.transport.close()


class _LoopKeptQueue(asyncio.Queue):  # type: ignore[type-arg]
    """asyncio.Queue asks for the running loop at every get() that waits (asyncio's _LoopBoundMixin), a
    getpid() system call on Python 3.11 (its fork check): once per frame a socket receives. This one
    keeps the protocol's loop, the only one it is used on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._kept_loop = loop

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        return self._kept_loop


class StrictTextWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (websockets' sans-I/O), with a text frame that is no UTF-8 closed
    with 1007 as before but logged as one INFO line: uvicorn logs it at ERROR with a traceback, so any
    client could fill the log with them. (A server's own failure still logs its traceback.) Its receive
    queue keeps its loop (_LoopKeptQueue)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queue = _LoopKeptQueue(self.loop)

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


# uvicorn's warnings for a connection that speaks no HTTP (a TLS hello, a port scanner) or asks to upgrade
# to anything but a WebSocket: a stranger's every connection wrote one, and they name no client, so they
# are one line per interval for all clients together.
ADDRESSLESS_LINES = frozenset({"Invalid HTTP request received.", "Unsupported upgrade request."})


class SocketLinesSampled(logging.Filter):
    """One line per client address per 10 s, with the count of those left out, for the lines every
    socket on /proto makes whatever it does: uvicorn's access line (`"WebSocket /proto" [accepted]`, or
    `403` when admission refused it before the upgrade) and the handshake time-out of a socket that
    never said who it is. 12 800 stranger sockets wrote 25 600 INFO lines in 25 s (issue 36, finding
    10); the refusals and evictions themselves already were one line per address per interval
    (workers.proto.admission). uvicorn's ADDRESSLESS_LINES are one per interval for all addresses. A
    worker's own session is still logged whole (`worker ... connected`)."""

    def __init__(self) -> None:
        super().__init__()
        self._lines = LineEvery(every_secs=10.0)

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message in ADDRESSLESS_LINES:
            return self._due(record, f"{record.name}:{message}", "since the last line")
        if '"WebSocket %s"' in message or ("rejected" in message and "handshake from" in message):
            args = record.args if isinstance(record.args, tuple) else ()
            if "handshake from" in message and "no InitConnection within" not in str(args[-1:]):
                return True  # a refused handshake that said something (a bad token): each one counts
            address = str(args[0]).rsplit(":", 1)[0] if args else ""
            return self._due(record, f"{record.name}:{address}", "from this address since the last line")
        return True

    def _due(self, record: logging.LogRecord, key: str, since: str) -> bool:
        unlogged = self._lines.due(key, time.monotonic())
        if unlogged is None:
            return False
        if unlogged:
            record.msg = f"{record.msg} ({unlogged} more like it {since})"
        return True


def sample_socket_lines() -> None:
    """Install SocketLinesSampled on uvicorn's and the consumer's loggers (after uvicorn configured its
    logging, which would not keep it otherwise)."""
    sampled = SocketLinesSampled()
    for name in ("uvicorn.error", "gradient.workers"):
        logging.getLogger(name).addFilter(sampled)
