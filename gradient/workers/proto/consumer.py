"""The /proto WebSocket consumer: transport only.

It decodes each text frame strictly into a typed message (gradient.core.protocol), checks that the
message is allowed in the session's state, and hands it to one service through
database_sync_to_async, via the explicit table JOB_LOOP; then it sends what the service returned.
Every protocol violation (too large, invalid JSON, unknown type, unknown or missing field, wrong type,
not allowed now) is answered with Error{400} and close code 4400 before anything touches the
database. Before InitAck the only acceptable message is InitConnection: another valid message is
refused with Reject{400} (close 4400), as the handshake says.

Pushes from anywhere (AssignJob, AbortJob, StartCluster, AbortCluster, ClusterSignal, JobOffer, and
orders to close) reach the consumer through the worker's channel-layer group (gradient.runtime.outbox).

Faults (docs/faults.md): a database connection that dies under a job-loop call (a restart,
pg_terminate_backend, a failover) is replaced and the call made again, so the worker keeps its session;
a channel layer that fails under the consumer (Redis restarted) ends the session cleanly, socket closed
with 1011 and session closed in the database, so the worker reconnects at once instead of waiting for
the liveness pass to free it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.db import InterfaceError, OperationalError, connection
from django.utils import timezone

from gradient.core.protocol import (
    CLOSE_PROTOCOL_ERROR,
    PROTOCOL_VERSION,
    AssignJobResponse,
    BuildLog,
    BuildProgress,
    ClusterSignal,
    Draining,
    Error,
    EvalProgress,
    InitAck,
    InitConnection,
    JobCompleted,
    JobFailed,
    JobUpdate,
    Message,
    ProtocolError,
    Reject,
    RequestJob,
    RequestJobChunk,
    RequestJobList,
    ServerMessage,
    WorkerCapabilities,
    WorkerMetrics,
    decode_worker_message,
    encode,
    tag_of,
)
from gradient.runtime.boot import current_boot
from gradient.runtime.outbox import CLOSE_SERVER_DRAINING, remember_serve_loop, worker_group
from gradient.workers import services
from gradient.workers.proto import jobloop
from gradient.workers.selectors import workers_with_open_assignments
from gradient.workers.services import HandshakeRejected, SessionRef

log = logging.getLogger("gradient.workers")

Handler = Callable[..., list[ServerMessage]]

# Every message allowed after InitAck, and the job-loop function that handles it. InitConnection is
# absent on purpose: a second one is a message not allowed in the current state.
JOB_LOOP: dict[type[Message], Handler] = {
    WorkerCapabilities: jobloop.worker_capabilities,
    WorkerMetrics: jobloop.worker_metrics,
    RequestJobList: jobloop.request_job_list,
    RequestJobChunk: jobloop.request_job_chunk,
    RequestJob: jobloop.request_job,
    AssignJobResponse: jobloop.assign_job_response,
    JobUpdate: jobloop.job_update,
    JobCompleted: jobloop.job_completed,
    JobFailed: jobloop.job_failed,
    BuildProgress: jobloop.build_progress,
    EvalProgress: jobloop.eval_progress,
    ClusterSignal: jobloop.cluster_signal,
    BuildLog: jobloop.build_log,
    Draining: jobloop.draining,
}

HANDSHAKE_TIMEOUT_SECS = 30.0
# "Seen" is written at most this often per session; a heartbeat always writes it.
SEEN_EVERY_SECS = 1.0
# Channel-layer group memberships expire (channels_redis: a day); a heartbeat renews it this often.
GROUP_RENEW_SECS = 600.0
# On SIGTERM: how long a session with open assignments may keep reporting before it is closed.
DRAIN_GRACE_SECS = 15.0
# A job-loop call whose database connection died is made again on a fresh connection this many times in
# all; a session close, which frees the worker to reconnect, too.
DB_ATTEMPTS = 3
DB_RETRY_PAUSE_SECS = 0.1
# How long a channel-layer call may take when the session ends; Redis may be the thing that is down.
CHANNEL_LAYER_TIMEOUT_SECS = 2.0

_live: weakref.WeakSet[WorkerConsumer] = weakref.WeakSet()
_server_draining = False


def _handle(handler: Handler, session: SessionRef, message: Message, mark_seen: bool) -> list[ServerMessage]:
    """One job-loop call. A lost database connection (OperationalError or InterfaceError outside any
    transaction: the transaction it was in has rolled back) is dropped and the call made again, up to
    DB_ATTEMPTS in all. Every job-loop function is safe to repeat: reports are fenced by their
    assignment_id, writes are conditional, and request_job hands out a claim whose commit it did not hear
    (jobloop.request_job)."""
    for attempt in range(1, DB_ATTEMPTS + 1):
        try:
            if mark_seen:
                services.worker_seen(session=session, now=timezone.now())
            return handler(session=session, message=message)
        except (OperationalError, InterfaceError) as exc:
            if attempt == DB_ATTEMPTS or connection.in_atomic_block:
                raise
            log.warning(
                "database connection lost handling %s from worker %s (%s); trying again",
                tag_of(type(message)),
                session.worker_id,
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )
            jobloop.drop_connection()
            time.sleep(DB_RETRY_PAUSE_SECS * attempt)
    raise AssertionError("unreachable")


def _close_session(session: SessionRef, reason: str) -> None:
    """Close the session in the database, retried on a lost connection: a session left open keeps its
    worker out (496) until the liveness pass. The close is conditional, so repeating it is harmless."""
    for attempt in range(1, DB_ATTEMPTS + 1):
        try:
            services.worker_session_close(session_id=session.session_id, reason=reason, now=timezone.now())
            return
        except (OperationalError, InterfaceError):
            if attempt == DB_ATTEMPTS:
                raise
            log.warning("database connection lost closing the session of %s; trying again", session.worker_id)
            jobloop.drop_connection()
            time.sleep(DB_RETRY_PAUSE_SECS * attempt)


def _forget_channel(layer: Any, channel_name: str | None) -> None:
    """Drop this consumer's entry in channels_redis' per-process receive buffer. The layer leaves one
    behind for every consumer whose receive was cancelled (django/channels_redis#212): a few kilobytes
    per connection, refused ones included, for as long as the process lives. The channel name is this
    consumer's own and never used again."""
    buffer = getattr(layer, "receive_buffer", None)
    if channel_name and isinstance(buffer, dict):
        buffer.pop(channel_name, None)


class WorkerConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]  # channels is untyped
    session: SessionRef | None
    closing: bool
    close_reason: str
    group: str | None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Channels' consumer loop, which ends by raising when the channel layer fails under it (Redis
        restarted: the receive on this consumer's channel raises). Then nothing would run disconnect():
        the session would stay open, refusing the worker's reconnection with 496 until the liveness
        pass. End the session cleanly instead: close the socket with 1011 and the session in the
        database, so the worker reconnects, and its jobs go back to the pool at once."""
        try:
            await super().__call__(scope, receive, send)
        except RuntimeError as exc:
            if "GeneratorExit" in str(exc):
                raise  # the consumer's own coroutine is being closed (its task torn down): not a failure
            await self._failed(send)
        except Exception:
            await self._failed(send)
        finally:
            _forget_channel(getattr(self, "channel_layer", None), getattr(self, "channel_name", None))

    async def _failed(self, send: Any) -> None:
        session = getattr(self, "session", None)
        log.exception(
            "the consumer of %s failed; ending its session",
            session.worker_id if session is not None else self._peer(),
        )
        await self._end_after_failure(send)

    async def _end_after_failure(self, send: Any) -> None:
        already_closing = getattr(self, "closing", False)
        self.closing = True
        self._cancel_handshake_timer()
        _live.discard(self)
        if not already_closing:
            try:
                await send({"type": "websocket.close", "code": 1011, "reason": "internal error"})
            except Exception:  # the socket is gone already
                log.debug("closing the socket after a failure failed", exc_info=True)
        await self._leave_group()
        await self._end_session(getattr(self, "close_reason", "") or "internal error: the consumer failed")

    async def connect(self) -> None:
        self.session = None
        self.closing = False
        self.close_reason = ""
        self.group = None
        self._seen_at = 0.0
        self._grouped_at = 0.0
        await self.accept()
        loop = asyncio.get_running_loop()
        remember_serve_loop(loop)
        _live.add(self)
        self._handshake_timer: asyncio.TimerHandle | None = loop.call_later(
            HANDSHAKE_TIMEOUT_SECS, self._on_handshake_timeout
        )
        self._tasks: set[asyncio.Task[None]] = set()

    # --- frames from the worker ---------------------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.closing:
            return
        if text_data is None:
            await self._violation("binary frames are not part of the protocol: send JSON text frames")
            return
        try:
            message = decode_worker_message(text_data)
        except ProtocolError as exc:
            await self._violation(str(exc))
            return
        if self.session is None:
            if not isinstance(message, InitConnection):
                await self._reject(400, f"expected InitConnection first, got {tag_of(type(message))}")
                return
            await self._handshake(message)
            return
        handler = JOB_LOOP.get(type(message))
        if handler is None:
            await self._violation(f"{tag_of(type(message))} is not allowed after InitAck")
            return
        await self._dispatch(handler, self.session, message)

    async def _handshake(self, message: InitConnection) -> None:
        self._cancel_handshake_timer()
        if message.protocol != PROTOCOL_VERSION:
            await self._reject(
                400, f"unsupported protocol {message.protocol}: this server speaks {PROTOCOL_VERSION}"
            )
            return
        try:
            result = await database_sync_to_async(services.worker_session_open)(
                worker_id=message.worker_id,
                token=message.token,
                capabilities=message.capabilities,
                channel_name=self.channel_name,
                server_boot=current_boot(),
                now=timezone.now(),
            )
        except Exception:
            log.exception("handshake of %s failed", self._peer())
            await self._close(1011, "internal error")
            return
        if isinstance(result, HandshakeRejected):
            await self._reject(result.code, result.reason)
            return
        self.session = result.session
        self._seen_at = time.monotonic()
        self.group = worker_group(result.session.worker_id)
        try:
            await self.channel_layer.group_add(self.group, self.channel_name)
        except Exception:  # no channel layer, no pushes: refuse the session rather than half-serve it
            log.exception("joining the channel-layer group of worker %s failed", result.session.worker_id)
            self.group = None
            await self._close(1011, "internal error: channel layer unavailable")
            return
        self._grouped_at = time.monotonic()
        await self._send(
            InitAck(
                worker_id=str(result.session.worker_id),
                protocol=PROTOCOL_VERSION,
                authorized_projects=result.authorized_projects,
            )
        )
        log.info("worker %s connected (session %s)", result.session.worker_id, result.session.session_id)
        if _server_draining:
            await self._send(Draining())

    async def _dispatch(self, handler: Handler, session: SessionRef, message: Message) -> None:
        now = time.monotonic()
        mark_seen = isinstance(message, WorkerMetrics) or now - self._seen_at >= SEEN_EVERY_SECS
        try:
            # Not thread-sensitive: sessions run their job-loop calls side by side, each in its own
            # transaction on its own thread's connection.
            replies = await database_sync_to_async(_handle, thread_sensitive=False)(
                handler, session, message, mark_seen
            )
        except Exception:
            # Our failure, not the worker's: no 400. Close; the worker reconnects and its jobs requeue.
            log.exception("handling %s from worker %s failed", tag_of(type(message)), session.worker_id)
            await self._close(1011, "internal error")
            return
        if mark_seen:
            self._seen_at = now
        for reply in replies:
            await self._send(reply)
        if isinstance(message, WorkerMetrics) and self.group and now - self._grouped_at >= GROUP_RENEW_SECS:
            # Failing here (Redis away) costs nothing: the next heartbeat tries again, and a lost channel
            # layer ends the session through __call__ anyway.
            try:
                await self.channel_layer.group_add(self.group, self.channel_name)
                self._grouped_at = now
            except Exception:
                log.warning("renewing the channel-layer group of worker %s failed", session.worker_id)

    # --- pushes through the channel layer -------------------------------------------------------------

    async def worker_push(self, event: dict[str, Any]) -> None:
        if self.session is None or self.closing:
            return
        await self.send(text_data=event["frame"])

    async def worker_close(self, event: dict[str, Any]) -> None:
        if self.session is None or self.closing:
            return
        session_id = event.get("session_id")
        if session_id is not None and session_id != str(self.session.session_id):
            return
        await self._close(int(event["code"]), str(event.get("reason") or "closed by the server"))

    # --- closing --------------------------------------------------------------------------------------

    async def disconnect(self, code: int) -> None:
        self._cancel_handshake_timer()
        _live.discard(self)
        await self._leave_group()
        await self._end_session(self.close_reason or f"disconnected ({code})")

    async def _leave_group(self) -> None:
        """Best effort: with the channel layer down the membership expires by itself, and the session
        must still be closed."""
        group, self.group = getattr(self, "group", None), None
        if group is None:
            return
        try:
            await asyncio.wait_for(
                self.channel_layer.group_discard(group, self.channel_name), CHANNEL_LAYER_TIMEOUT_SECS
            )
        except Exception:
            log.warning("leaving the channel-layer group %s failed", group)

    async def _end_session(self, reason: str) -> None:
        """Close the session in the database, once (disconnect and a failure may both get here)."""
        session = getattr(self, "session", None)
        if session is None or getattr(self, "_session_ended", False):
            return
        self._session_ended = True
        try:
            await database_sync_to_async(_close_session)(session, reason)
        except Exception:
            log.exception("closing the session of %s failed; the liveness pass will", session.worker_id)
            return
        log.info("worker %s disconnected: %s", session.worker_id, reason)

    async def _send(self, message: ServerMessage) -> None:
        await self.send(text_data=encode(message))

    async def _violation(self, detail: str) -> None:
        log.info("protocol violation from %s: %s", self._peer(), detail)
        await self._send_and_close(
            Error(code=400, message=detail), CLOSE_PROTOCOL_ERROR, f"protocol error: {detail}"
        )

    async def _reject(self, code: int, reason: str) -> None:
        log.info("handshake from %s rejected (%s): %s", self._peer(), code, reason)
        await self._send_and_close(Reject(code=code, reason=reason), 4000 + code, f"rejected: {reason}")

    async def _send_and_close(self, frame: ServerMessage, close_code: int, reason: str) -> None:
        if self.closing:
            return
        self.closing = True
        self.close_reason = reason
        self._cancel_handshake_timer()
        await self._send(frame)
        await self.close(code=close_code)

    async def _close(self, code: int, reason: str) -> None:
        if self.closing:
            return
        self.closing = True
        self.close_reason = reason
        await self.close(code=code)

    def _on_handshake_timeout(self) -> None:
        self._handshake_timer = None
        if self.session is None and not self.closing:
            task = asyncio.ensure_future(
                self._reject(400, f"no InitConnection within {HANDSHAKE_TIMEOUT_SECS:g} s")
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _cancel_handshake_timer(self) -> None:
        timer = getattr(self, "_handshake_timer", None)
        if timer is not None:
            timer.cancel()
            self._handshake_timer = None

    def _peer(self) -> str:
        client = self.scope.get("client")
        return f"{client[0]}:{client[1]}" if client else "a client"

    # --- server drain ---------------------------------------------------------------------------------

    async def drain_begin(self) -> None:
        if self.session is not None and not self.closing:
            await self._send(Draining())

    async def drain_close(self) -> None:
        await self._close(CLOSE_SERVER_DRAINING, "server draining")


async def drain_local_sessions(*, grace_secs: float = DRAIN_GRACE_SECS) -> int:
    """The server is stopping (SIGTERM): send Draining to every session this process holds, give the
    ones with open assignments up to `grace_secs` to report, and close them all. Returns how many
    sessions it closed."""
    global _server_draining
    _server_draining = True
    consumers = list(_live)
    if not consumers:
        return 0
    await database_sync_to_async(services.sessions_of_boot_mark_draining)(server_boot=current_boot())
    for consumer in consumers:
        await consumer.drain_begin()
    deadline = time.monotonic() + grace_secs
    while True:
        pending = [c for c in consumers if not c.closing]
        if not pending:
            break
        worker_ids = [c.session.worker_id for c in pending if c.session is not None]
        busy = await database_sync_to_async(workers_with_open_assignments)(worker_ids=worker_ids)
        out_of_time = time.monotonic() >= deadline
        for consumer in pending:
            if out_of_time or consumer.session is None or consumer.session.worker_id not in busy:
                await consumer.drain_close()
        await asyncio.sleep(0.2)
    return len(consumers)
