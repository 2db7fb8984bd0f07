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
import struct
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import PayloadTooBig, ProtocolError
from websockets.frames import (  # type: ignore[attr-defined]  # apply_mask: its C speedup where built
    CloseCode,
    Frame,
    Opcode,
    apply_mask,
)
from websockets.protocol import State

from gradient.core.lines import LineEvery
from gradient.runtime.frames import FRAMES_SCOPE_KEY
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


_TEXT_FIN = 0x81  # FIN, no RSV bit, opcode TEXT: a whole text message in one frame
_TEXT_FIN_RSV1 = 0xC1  # the same, compressed (permessage-deflate's RSV1)
_MASKED = 0x80


class StrictTextWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (websockets' sans-I/O), with a text frame that is no UTF-8 closed
    with 1007 as before but logged as one INFO line: uvicorn logs it at ERROR with a traceback, so any
    client could fill the log with them. (A server's own failure still logs its traceback.) Its receive
    queue keeps its loop (_LoopKeptQueue).

    And the hot path's frames straight through (FramePath, scope[FRAMES_SCOPE_KEY]): per hand-out a
    worker sends five frames, and each went through websockets' generator-based parser, the ASGI
    queue, a step of the consumer's task, its dispatch lock and uvicorn's reading paused and resumed
    (two epoll changes); together about a fifth of serve's time under load. Once the handshake is done
    this protocol reads the frames itself: a whole text frame (FIN, masked, within the size limit, no
    fragmented message open; compressed by the negotiated permessage-deflate or not) is unmasked here
    (websockets' C speedup), inflated by websockets' own extension where it was compressed, and handed to the
    consumer's `receiver` while nothing of the socket waits in the ASGI queue; a receiver that cannot
    take it at once (the session not open yet, a message being dispatched, its inbox full: back-
    pressure) returns False and it goes through the queue as before. Every other frame (ping, pong,
    close, binary, a fragment, one too large, a malformed one) goes whole to
    websockets' parser, which is then at a frame boundary as it would be had it read every frame
    itself, so its answers (pong, close echo, 1002, 1009) are its own; a frame too large for the limit
    goes to it as soon as its header is here, so it is refused before its payload arrives, as before.
    The parser's state is the same either way: it only counts the size of a fragmented message, and
    such frames go to it. Once the connection is closing everything goes to websockets."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queue = _LoopKeptQueue(self.loop)
        self.receiver: Callable[[str], bool] | None = None
        self._own_frames = False  # frames are read here, not by websockets (data_received)
        self._frames_decided = False  # whether they will be is decided at the handshake's end (send)
        self._unread = b""  # the start of a frame whose end has not arrived

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope[FRAMES_SCOPE_KEY] = self

    async def send(self, message: Any) -> None:
        await super().send(message)
        if not self._frames_decided and self.handshake_complete:
            # The app's first message decided the handshake (ASGI's accept, close or HTTP response):
            # frames are read here from now on if it was accepted and nothing of the client's was read
            # past its request (the parser is at a frame boundary).
            self._frames_decided = True
            self._own_frames = (
                not self.close_sent
                and self.initial_response is None
                and self.conn.state is State.OPEN
                and not self.conn.reader.buffer
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver = None  # the consumer and this protocol point at each other
        self._own_frames = False
        super().connection_lost(exc)

    def send_text_now(self, text: str) -> bool:
        """Send a text frame now, unless the socket is not simply open for writing (closing, closed,
        its buffer full): then False, and the caller goes through ASGI's send."""
        if (
            self.close_sent
            or self.disconnected
            or not self.handshake_complete
            or self.initial_response is not None
            or not self.writable.is_set()
            or self.conn.state is not State.OPEN
            or self.transport.is_closing()
        ):
            return False
        if self.conn.extensions:  # compressed as websockets compresses it, in order
            self.conn.send_text(text.encode())
            self.transport.write(b"".join(self.conn.data_to_send()))
            return True
        payload = text.encode()
        size = len(payload)
        if size < 126:
            header = bytes((_TEXT_FIN, size))
        elif size < 65536:
            header = struct.pack("!BBH", _TEXT_FIN, 126, size)
        else:
            header = struct.pack("!BBQ", _TEXT_FIN, 127, size)
        self.transport.write(header + payload)
        return True

    def data_received(self, data: bytes) -> None:
        if not self._own_frames:
            super().data_received(data)
            return
        if self._unread:
            data, self._unread = self._unread + data, b""
        end = len(data)
        at = 0
        while at < end:
            if not self._own_frames:  # closing (a close frame, a 1007): the rest is websockets'
                super().data_received(data[at:])
                return
            if end - at < 2:
                break
            head1, head2 = data[at], data[at + 1]
            length = head2 & 0x7F
            start = at + 2
            if length == 126:
                if end - start < 2:
                    break
                (length,) = struct.unpack_from("!H", data, start)
                start += 2
            elif length == 127:
                if end - start < 8:
                    break
                (length,) = struct.unpack_from("!Q", data, start)
                start += 8
            limit = self.conn.max_message_size
            if not head2 & _MASKED or (limit is not None and length > limit):
                # Refused by websockets from its header (1002: a client's frame must be masked; 1009),
                # before the payload arrives.
                self._own_frames = False
                super().data_received(data[at:])
                return
            stop = start + 4 + length
            if stop > end:
                break
            if (
                (head1 == _TEXT_FIN or (head1 == _TEXT_FIN_RSV1 and self.conn.extensions))
                and self.conn.current_size is None
                and not self.close_sent
                and self.conn.state is State.OPEN
            ):
                payload = apply_mask(data[start + 4 : stop], data[start : start + 4])
                message = self._inflated(payload, limit) if head1 == _TEXT_FIN_RSV1 else payload
                if message is None or not self._text_frame(message):
                    return  # the connection failed: closing
            else:
                super().data_received(data[at:stop])  # one whole frame: the parser ends at a boundary
                if self.conn.state is not State.OPEN or self.close_sent or self.conn.parser_exc is not None:
                    self._own_frames = False
                    if stop < end and self.conn.parser_exc is None:
                        super().data_received(data[stop:])
                    return
            at = stop
        if at < end:
            self._unread = data[at:]

    def _text_frame(self, payload: bytes) -> bool:
        """A whole text message: to the receiver or the ASGI queue. False when it is no UTF-8 (1007)."""
        try:
            text = payload.decode()
        except UnicodeDecodeError as exc:
            self._own_frames = False
            self._not_utf8(exc)
            return False
        receiver = self.receiver
        if receiver is None or self.queue.qsize() or not receiver(text):
            self._to_app(text)
        return True

    def _inflated(self, payload: bytes, limit: int | None) -> bytes | None:
        """A compressed frame's payload through the negotiated extensions (permessage-deflate, as the
        reference worker's client asks for), as websockets' parser runs them: its decompressor sees
        every compressed frame in order, here or there. None when they refuse it: the connection is
        failed as websockets would fail it (1002, 1009, 1011)."""
        frame = Frame(Opcode.TEXT, payload, fin=True, rsv1=True)
        try:
            for extension in reversed(self.conn.extensions):
                frame = extension.decode(frame, max_size=limit)
            frame.check()
        except ProtocolError as exc:
            self._fail(CloseCode.PROTOCOL_ERROR, str(exc))
            return None
        except PayloadTooBig as exc:
            self._fail(CloseCode.MESSAGE_TOO_BIG, str(exc))
            return None
        except Exception:
            log.exception("decompressing a /proto frame failed")
            self._fail(CloseCode.INTERNAL_ERROR, "")
            return None
        return bytes(frame.data)

    def _fail(self, code: int, reason: str) -> None:
        """What websockets' parser does with a frame it refuses: close with `code`, and the socket."""
        self._own_frames = False
        self.conn.fail(code, reason)
        self.handle_parser_exception()

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type != "text" or self.close_sent:
            super().send_receive_event_to_app()
            return
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            self._not_utf8(exc)
            return
        self._to_app(text)

    def _to_app(self, text: str) -> None:
        self.queue.put_nowait({"type": "websocket.receive", "text": text})
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def _not_utf8(self, exc: UnicodeDecodeError) -> None:
        client = self.client
        log.info(
            "closed a /proto socket of %s with 1007: a text frame is no UTF-8 (%s)",
            f"{client[0]}:{client[1]}" if client else "a client",
            exc.reason,
        )
        self.conn.send_close(1007)
        self.handle_parser_exception()


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
