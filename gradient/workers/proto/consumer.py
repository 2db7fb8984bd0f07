"""The /proto WebSocket consumer: transport only.

It decodes each text frame strictly into a typed message (gradient.core.protocol), checks that the
message is allowed in the session's state, and queues it for the session's own task, which hands it to
one service on a database lane (gradient.runtime.lanes), via the explicit table JOB_LOOP, or to the
report batcher; then it sends what the service returned.
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

A report the database cannot store (a data error: a value too long for its column, say) costs neither
the session nor its jobs: its transaction rolled back, so it changed nothing; a result or a failure
(JobUpdate, JobCompleted, JobFailed) then fails its assignment as `transient`, with the reason, so the
job is tried again, and any other message is dropped. Either way it is logged with its traceback.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, get_args

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import DataError, InterfaceError, OperationalError
from django.utils import timezone

from gradient.core.ids import parse_uuid
from gradient.core.lines import first_line
from gradient.core.protocol import (
    CLOSE_PROTOCOL_ERROR,
    PROTOCOL_VERSION,
    AssignJob,
    AssignJobResponse,
    BuildLog,
    BuildProgress,
    ClusterSignal,
    Draining,
    Error,
    EvalProgress,
    EvalResult,
    InitAck,
    InitConnection,
    JobCompleted,
    JobFailed,
    JobUpdate,
    Message,
    ProtocolError,
    QueryKnownDerivations,
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
from gradient.runtime import lanes
from gradient.runtime.boot import current_boot
from gradient.runtime.frames import FRAMES_SCOPE_KEY, FramePath
from gradient.runtime.outbox import CLOSE_SERVER_DRAINING, remember_serve_loop, worker_group
from gradient.scheduling.services.reports import Failed, Incoming
from gradient.workers import presence, services
from gradient.workers.proto import admission, dispatcher, jobloop, known
from gradient.workers.proto.dispatcher import MAX_REPORTS_BATCH, Batcher, batcher_for
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
    QueryKnownDerivations: known.query_known_derivations,
    Draining: jobloop.draining,
}

# Reports, answers and log pieces (what reports.worker_reports takes): applied in batches with every
# other session's (dispatcher.py). An eval_result goes alone (a batch of one): its part may take long to
# store and must not hold up others.
BATCHED: tuple[type[Message], ...] = get_args(Incoming)
_BATCHED_TYPES = frozenset(BATCHED)  # a decoded message's type is exactly its class (as JOB_LOOP's)
# A session's messages queued for its task beyond this many bytes make its socket wait (back-pressure);
# after the socket closed, what it queued is applied within INBOX_DRAIN_SECS.
INBOX_MAX_BYTES = 4 * 1024 * 1024
INBOX_DRAIN_SECS = 10.0
# RequestJob{build} of every session, collected this long and claimed together (one transaction).
CLAIM_WINDOW_SECS = 0.002
# InitConnections of every socket, collected this long and their sessions opened together.
HANDSHAKE_WINDOW_SECS = 0.002
# WorkerCapabilities of every session, collected this long and stored together.
CAPABILITIES_WINDOW_SECS = 0.002
# The offers after WorkerCapabilities of every session, collected this long and made together.
OFFER_WINDOW_SECS = 0.005
# ... and made once the claim batcher has nothing queued nor being applied, or after this long: a
# fleet's first offers (a deep queue: 1 000 candidates made and ~300 KB sent to each worker) went in
# front of its first RequestJobs, answered 175-230 ms after they were sent where the later ones took
# 40-60 ms (bench/handout.py, 100 clients). An offer is advice the worker scores; an AssignJob is work.
OFFER_YIELD_SECS = 0.25
# A session's RequestJob{build} goes to the claim batcher once the reports it queued before its
# RequestJob this many requests back have been applied (_run_inbox): its claims never outrun its reports
# by more. Two: with one, a request waited for reports sent a round before it, and a report batch (a
# fleet's reports of 20-30 ms, applied one batch at a time) often had not applied them yet: 5 ms of its
# 37 ms on average, 16 at p90 (bench/handout.py, 100 clients). The claim counts the worker's builds whose
# end is among the reports still on their way (`finishing`), however many rounds they span.
REPORT_ROUNDS_AHEAD = 2
# A RequestJob whose claims all lost (another process took those builds in the same moment) goes into
# up to this many next batches before it is left to the worker's own repeat.
ASK_AGAIN_BATCHES = 3
# Offers take long with a deep queue: their own lane, never in front of a claim or a report.
OFFER_LANE: tuple[type[Message], ...] = (RequestJobList, RequestJobChunk)

# A socket that has not sent its InitConnection by then is refused (Reject{400}); a test may lower it.
HANDSHAKE_TIMEOUT_SECS = float(settings.GRADIENT_PROTO_HANDSHAKE_TIMEOUT_SECS)
# Channel-layer group memberships expire (channels_redis: a day); a heartbeat renews it this often.
GROUP_RENEW_SECS = 600.0
BUSY_BODY = b"Busy: every connection not yet handshaken is being answered; try again.\r\n"
# On SIGTERM: how long a session with open assignments may keep reporting before it is closed.
DRAIN_GRACE_SECS = 15.0
# A job-loop call whose database connection died is made again on a fresh connection this many times in
# all; a session close, which frees the worker to reconnect, too.
DB_ATTEMPTS = lanes.DB_ATTEMPTS
DB_RETRY_PAUSE_SECS = lanes.DB_RETRY_PAUSE_SECS
# How long a channel-layer call may take when the session ends; Redis may be the thing that is down.
CHANNEL_LAYER_TIMEOUT_SECS = 2.0

_live: weakref.WeakSet[WorkerConsumer] = weakref.WeakSet()
# The consumer holding each worker's session in this process, until that session has ended: a worker
# that reconnects while its last socket's close is still being handled waits for it (a few milliseconds)
# instead of being refused with 496 by the session it has just lost.
_held: weakref.WeakValueDictionary[str, WorkerConsumer] = weakref.WeakValueDictionary()
RECONNECT_WAIT_SECS = 10.0
_server_draining = False


def _handle(handler: Handler, session: SessionRef, message: Message) -> list[ServerMessage]:
    """One job-loop call, on a lane thread. A lost database connection is dropped and the call made
    again, up to DB_ATTEMPTS in all (lanes.retrying). Every job-loop function is safe to repeat: reports
    are fenced by their assignment_id, writes are conditional, and request_job hands out a claim whose
    commit it did not hear (assignment.hand_out). A value the database refuses (a DataError) costs the
    session nothing: the message is dropped, logged with its traceback (reports contain theirs
    themselves: scheduling.services.reports)."""
    try:
        return lanes.retrying(
            functools.partial(handler, session=session, message=message),
            what=f"handling {tag_of(type(message))} from worker {session.worker_id}",
            logger=log,
            attempts=DB_ATTEMPTS,
            pause=DB_RETRY_PAUSE_SECS,
        )
    except DataError as exc:
        log.error(
            "the database refused %s from worker %s (%s); the session goes on",
            tag_of(type(message)),
            session.worker_id,
            first_line(exc),
            exc_info=True,
        )
        return []


def _close_session(session: SessionRef, reason: str) -> None:
    """Close the session in the database, retried on a lost connection: a session left open keeps its
    worker out (496) until the liveness pass. The close is conditional, so repeating it is harmless."""
    lanes.retrying(
        functools.partial(
            services.worker_session_close, session_id=session.session_id, reason=reason, now=timezone.now()
        ),
        what=f"closing the session of {session.worker_id}",
        logger=log,
        attempts=DB_ATTEMPTS,
        pause=DB_RETRY_PAUSE_SECS,
    )


# Sessions of this process whose socket is gone but whose close the database did not take (it was away:
# a restart, an outage). Each is still open in the database, so its worker's reconnection is refused with
# 496, wherever it comes; this process knows they are dead, and closes them as soon as the database
# answers again (_reap_unclosed), instead of leaving them to the liveness pass (120 s by default).
_unclosed: dict[Any, tuple[SessionRef, str]] = {}
_reaper: asyncio.Task[None] | None = None
REAP_EVERY_SECS = 0.5
REAP_MAX_PAUSE_SECS = 2.0


def _remember_unclosed(session: SessionRef, reason: str) -> None:
    global _reaper
    _unclosed[session.session_id] = (session, reason)
    loop = asyncio.get_running_loop()
    if _reaper is None or _reaper.done() or _reaper.get_loop() is not loop:
        _reaper = loop.create_task(_reap_unclosed())


def _close_unclosed_once(session: SessionRef, reason: str) -> None:
    """One try, on a fresh connection if the last one died."""
    lanes.retrying(
        functools.partial(
            services.worker_session_close, session_id=session.session_id, reason=reason, now=timezone.now()
        ),
        what=f"closing the session of {session.worker_id}",
        logger=log,
        attempts=1,
    )


async def _reap_unclosed() -> None:
    """Close every session in _unclosed, trying again every REAP_EVERY_SECS (doubling up to
    REAP_MAX_PAUSE_SECS) while the database is away; ends when none is left."""
    pause = REAP_EVERY_SECS
    while _unclosed:
        await asyncio.sleep(pause)
        for session_id, (session, reason) in list(_unclosed.items()):
            try:
                await lanes.run(lanes.SESSIONS, _close_unclosed_once, session, reason)
            except (OperationalError, InterfaceError):
                pause = min(pause * 2, REAP_MAX_PAUSE_SECS)
                break
            except Exception:
                log.exception("closing the session of %s failed; the liveness pass will", session.worker_id)
                _unclosed.pop(session_id, None)
                continue
            _unclosed.pop(session_id, None)
            pause = REAP_EVERY_SECS
            log.info(
                "worker %s disconnected: %s (closed once the database answered)", session.worker_id, reason
            )


# What a close code the server did not send itself most likely means (websockets reports 1006 when the
# connection ended without a close frame; a keepalive ping that went unanswered ends it so).
_DISCONNECT_CAUSES = {
    1005: "the connection ended without a close frame from the worker: the keepalive ping went "
    "unanswered for ws_ping_timeout (uvicorn then closes with 1011), or the network or the worker failed",
    1006: "no close frame: the keepalive ping went unanswered, or the network or the peer failed",
    1011: "keepalive ping timeout or an internal error",
}


def _reports_batcher(loop: asyncio.AbstractEventLoop) -> Batcher:
    return batcher_for(dispatcher.reports_batch, max_batch=MAX_REPORTS_BATCH, loop=loop)


def _seen_now() -> datetime:
    """timezone.now() for when a frame came (USE_TZ is always on: gradient.settings), without its
    settings lookup through Django's lazy object: twice a frame."""
    return datetime.now(UTC)


# A session's worker is noted seen (presence.note_seen) at most once in this many seconds: every frame
# noted it, five per hand-out, each with a lock and a clock read; seen is flushed every few seconds and
# judged against a liveness timeout of minutes.
SEEN_EVERY_SECS = 0.1


def _finishing(pending: list[tuple[asyncio.Future[Any], Message]]) -> int:
    """How many builds the queued reports not applied yet end: a build job's JobCompleted or JobFailed,
    or its AssignJob declined."""
    ended = 0
    for _, message in pending:
        if isinstance(message, (JobCompleted, JobFailed)) or (
            isinstance(message, AssignJobResponse) and not message.accepted
        ):
            ended += message.job_id.startswith("build:")
    return ended


def _is_eval_result(message: Message) -> bool:
    return isinstance(message, JobUpdate) and isinstance(message.update, EvalResult)


# The presence flush of this process: what every session showed (seen, metrics) written together every
# presence.flush_every_secs(), on the sessions lane, from a task on the serve loop.
_flushers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
    weakref.WeakKeyDictionary()
)


def _start_flusher() -> None:
    loop = asyncio.get_running_loop()
    task = _flushers.get(loop)
    if task is None or task.done():
        _flushers[loop] = loop.create_task(_flush_every())


# The flusher also watches the event loop: when its sleep ends this much later than asked, the loop has
# been held up (by work that should be on a lane), and every socket with it; that is logged.
LOOP_LATE_SECS = 1.0
_loop_late_logged = 0.0


async def _flush_every() -> None:
    global _loop_late_logged
    while True:
        asked = time.monotonic()
        every = presence.flush_every_secs()
        await asyncio.sleep(every)
        late = time.monotonic() - asked - every
        if late >= LOOP_LATE_SECS and time.monotonic() - _loop_late_logged >= 10.0:
            _loop_late_logged = time.monotonic()
            log.warning(
                "the event loop of this process ran %.1f s late (calls on the lanes: %s): sockets are "
                "read and pinged that much later",
                late,
                ", ".join(f"{lane.name} {lane.busy}" for lane in lanes.LANES),
            )
        try:
            await flush_presence()
        except Exception as exc:  # the database away: the entries wait for the next flush
            log.warning("flushing the workers' presence failed (%s); trying again", first_line(exc))


async def flush_presence() -> int:
    """Write what every session of this process showed since the last flush, now (the flusher does it
    every few seconds; tests that read last_seen or metrics right after a message call it first)."""
    return await lanes.run(lanes.SESSIONS, _handle_flush)


def _handle_flush() -> int:
    return lanes.retrying(jobloop.presence_flush, what="flushing the presence", logger=log, attempts=1)


def _forget_channel(layer: Any, channel_name: str | None) -> None:
    """Drop this consumer's entry in channels_redis' per-process receive buffer. The layer leaves one
    behind for every consumer whose receive was cancelled (django/channels_redis#212): a few kilobytes
    per connection, refused ones included, for as long as the process lives. The channel name is this
    consumer's own and never used again."""
    buffer = getattr(layer, "receive_buffer", None)
    if channel_name and isinstance(buffer, dict):
        buffer.pop(channel_name, None)


async def _dispatch_many(
    sources: list[Callable[[], Any]], dispatch: Callable[[Any], Any], lock: asyncio.Lock | None = None
) -> None:
    """What Channels' `await_many_dispatch` does: every message of every source dispatched, one at a
    time, each source asked again once its message was dispatched; the first failure (StopConsumer
    included) ends it once the dispatch under way, if any, has finished (a handshake cut in half would
    leave its session open), and nothing more is dispatched; the sources' pending receives are
    cancelled. Channels makes a task per message and an `asyncio.wait` over all of them for each (about
    a fifth of the event loop's time under load); here each source has one task for its lifetime that
    receives and dispatches in a loop, the dispatches kept one at a time by a lock (0.7 against 12 us a
    message where a message is ready). Cancelled from outside, it cancels everything at once, the
    dispatch under way included, as Channels' loop is. `lock` is held while a message is dispatched
    (and from its end on, for good): the socket's direct frame path (WorkerConsumer.receive_now) takes
    a frame only while it is free."""
    if lock is None:
        lock = asyncio.Lock()
    stopped = False

    async def pump(source: Callable[[], Any]) -> None:
        nonlocal stopped
        try:
            while not stopped:
                message = await source()
                async with lock:
                    if stopped:
                        return
                    await dispatch(message)
        except BaseException:
            stopped = True
            raise

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        stopped = True
        await lock.acquire()  # the dispatch under way ends first; none after it (the lock stays held)
    finally:
        stopped = True
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except BaseException:  # noqa: S110 (raised below, in source order)
                pass
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            task.result()  # the first to fail, in source order


def _closed_already(exc: RuntimeError) -> bool:
    """uvicorn's refusal of a send after the socket's close (its own, for a frame that was no UTF-8, or
    a parser error): no failure of ours, the disconnect that follows ends the session."""
    return "after sending 'websocket.close'" in str(exc)


class WorkerConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]  # channels is untyped
    session: SessionRef | None
    closing: bool
    handshaking: bool
    close_reason: str
    group: str | None
    _frames: FramePath | None = None  # the socket's direct frame path (connect)
    _sends_waiting = 0  # frames in ASGI's send, not out yet
    _seen_at = float("-inf")  # when the worker was last noted seen (the loop's clock)

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch without its per-frame `aclose_old_connections()`, a hop to a thread and back
        for every frame (design/hot-path.md: ~70 % of a stock consumer's CPU). Skipping it is safe here:
        this consumer never touches the ORM from the event loop or Channels' thread-sensitive executor;
        its database work runs on the lanes' own threads (gradient.runtime.lanes), whose long-lived
        connections are kept healthy there (a dead one is dropped and the call made again), and its few
        `database_sync_to_async` calls (the server's drain) close old connections themselves. A frame
        goes to receive() at once, as AsyncWebsocketConsumer.websocket_receive would pass it."""
        if message["type"] == "websocket.receive":
            text = message.get("text")
            if text is not None:
                await self.receive(text_data=text)
            else:
                await self.receive(bytes_data=message.get("bytes"))
            return
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Channels' consumer loop, which ends by raising when the channel layer fails under it (Redis
        restarted: the receive on this consumer's channel raises). Then nothing would run disconnect():
        the session would stay open, refusing the worker's reconnection with 496 until the liveness
        pass. End the session cleanly instead: close the socket with 1011 and the session in the
        database, so the worker reconnects, and its jobs go back to the pool at once."""
        try:
            await self._consume(scope, receive, send)
        except OSError as exc:  # uvicorn's ClientDisconnected: the peer left while we wrote to it
            log.info("%s left before the server was done with it (%s)", self._who(), type(exc).__name__)
            await self._end_after_failure(send)
        except RuntimeError as exc:
            if "GeneratorExit" in str(exc):
                raise  # the consumer's own coroutine is being closed (its task torn down): not a failure
            await self._failed(send)
        except Exception:
            await self._failed(send)
        finally:
            _forget_channel(getattr(self, "channel_layer", None), getattr(self, "channel_name", None))

    async def _consume(self, scope: Any, receive: Any, send: Any) -> None:
        """Channels' AsyncConsumer.__call__ (its channel on the layer, then every message of the socket and
        of the channel dispatched one at a time, in the order they are found), waiting for the next
        message through `_dispatch_many` instead of Channels' `await_many_dispatch`, whose
        `asyncio.wait` per frame was about a fifth of the event loop's time under load."""
        self.scope = scope
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        sources = [receive]
        if self.channel_layer is not None:
            self.channel_name = await self.channel_layer.new_channel()
            self.channel_receive = functools.partial(self.channel_layer.receive, self.channel_name)
            sources.append(self.channel_receive)
        self.base_send = send
        self._dispatching = asyncio.Lock()
        try:
            await _dispatch_many(sources, self.dispatch, self._dispatching)
        except StopConsumer:
            pass
        finally:
            self._unhook()

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
        self._grouped_at = 0.0
        self._offering: asyncio.Task[None] | None = None
        self._offer_again = False
        self._inbox: deque[tuple[Handler, Message, int]] = deque()
        self._inbox_bytes = 0
        self._inbox_room = asyncio.Event()
        self._inbox_room.set()
        self._runner: asyncio.Task[None] | None = None
        self._arrival: asyncio.Future[None] | None = None  # set when the inbox gets a message
        # The session's reports queued for the report batcher whose results the inbox's task has not
        # seen yet (_run_inbox), in the order they came.
        self._pending: list[tuple[asyncio.Future[Any], Message]] = []
        self._ended = asyncio.Event()
        self._build_slots = 1
        self.handshaking = False
        # Strangers (no handshake yet) are capped; the oldest make room for a newcomer (admission.py).
        address = str(self.scope["client"][0]) if self.scope.get("client") else ""
        if not await admission.admit(self, address):
            self.closing = True
            await self._refuse_busy()
            return
        await self.accept()
        admission.register(self, address)
        # Kept: asking for the running loop is a getpid() system call on Python 3.11 (dispatcher.Batcher).
        loop = self._loop = asyncio.get_running_loop()
        remember_serve_loop(loop)
        _live.add(self)
        self._handshake_timer: asyncio.TimerHandle | None = loop.call_later(
            HANDSHAKE_TIMEOUT_SECS, self._on_handshake_timeout
        )
        self._tasks: set[asyncio.Task[None]] = set()
        # The socket's direct frame path, where its protocol offers one (serve's; not a test's
        # communicator): frames handed to receive_now, frames sent without ASGI's send (_send_text).
        frames: FramePath | None = self.scope.get(FRAMES_SCOPE_KEY)
        self._frames = frames
        if frames is not None:
            frames.receiver = self.receive_now

    def _unhook(self) -> None:
        frames = getattr(self, "_frames", None)
        if frames is not None:
            frames.receiver = None
            self._frames = None

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
        # Handled by the session's own task, in order; this returns at once, so the socket goes on being
        # read (uvicorn reads no more frames, pongs included, until receive returns) and the keepalive
        # ping is answered however long a call waits on its lane. A session that sends faster than it is
        # served waits here once INBOX_MAX_BYTES are queued: back-pressure, never a close.
        self._take(self.session, handler, message, len(text_data))
        if self._inbox_bytes > INBOX_MAX_BYTES:
            self._inbox_room.clear()
            await self._inbox_room.wait()

    def receive_now(self, text: str) -> bool:
        """A text frame straight from the socket's protocol (http_protocol.FramePath), which hands it
        over only while nothing of this socket waits in the ASGI queue: taken here at once as receive()
        would take it, or False, and it goes through the queue and receive() instead. False while a
        message (the socket's or the channel layer's) is being dispatched, before the handshake, once
        closing, for a frame receive() answers with an error, and where it would fill the inbox past
        INBOX_MAX_BYTES (receive() then waits for room: back-pressure). Nothing is done before the
        answer is known, so a frame refused here is handled once, there."""
        session = self.session
        if session is None or self.closing or self._dispatching.locked():
            return False
        if self._inbox_bytes + len(text) > INBOX_MAX_BYTES:
            return False
        try:
            message = decode_worker_message(text)
        except ProtocolError:
            return False
        handler = JOB_LOOP.get(type(message))
        if handler is None:
            return False
        self._take(session, handler, message, len(text))
        return True

    def _take(self, session: SessionRef, handler: Handler, message: Message, size: int) -> None:
        """A message of the open session, allowed now: to the report batcher or the inbox's task."""
        if isinstance(message, RequestJob) and self._requests_waiting(message.kind) >= self._slots(
            message.kind
        ):
            # A worker asks again every 10 s while a slot is idle: while as many requests as it has slots
            # still wait here, unanswered, the repeat would find its slots taken; it is dropped.
            return
        if not self._inbox and self._pipelined(message):
            # Nothing of the session's waits before it: a report goes to the report batcher from here,
            # as the inbox's task would send it, without waking that task for it (four reports a
            # hand-out, a task step each); the task sees its result with the others'.
            self._queue_report(session, message)
            if self._runner is None or self._runner.done():
                self._runner = self._loop.create_task(self._run_inbox(session))
            return
        self._inbox.append((handler, message, size))
        self._inbox_bytes += size
        arrival = self._arrival
        if arrival is not None and not arrival.done():
            arrival.set_result(None)
        if self._runner is None or self._runner.done():
            self._runner = self._loop.create_task(self._run_inbox(session))

    def _queue_report(self, session: SessionRef, message: Message) -> None:
        """The worker was seen; its report goes to the report batcher, its result to the session's
        pending reports (the inbox's task settles them in order)."""
        self._note_seen(session)
        self._pending.append((_reports_batcher(self._loop).enqueue(session, message), message))

    def _note_seen(self, session: SessionRef) -> None:
        """The worker was seen now (at most once per SEEN_EVERY_SECS: the seen kept may be that much
        older than the worker's last frame)."""
        at = self._loop.time()
        if at - self._seen_at >= SEEN_EVERY_SECS:
            self._seen_at = at
            presence.note_seen(session_id=session.session_id, worker_id=session.worker_id, now=_seen_now())

    def _requests_waiting(self, kind: str) -> int:
        """RequestJobs of this kind queued and not yet started (the first entry is being handled)."""
        return sum(1 for _, m, _ in list(self._inbox)[1:] if isinstance(m, RequestJob) and m.kind == kind)

    def _slots(self, kind: str) -> int:
        """The worker's build slots as its last WorkerCapabilities said (one before it said any); one for
        evaluations (the worker limits those itself, so only exact repeats are dropped)."""
        return max(1, self._build_slots) if kind == "build" else 1

    async def _run_inbox(self, session: SessionRef) -> None:
        # Reports are queued for the report batcher without waiting for each one's result (they apply in
        # order, and a report waits for nothing but its batch); any other message first waits until
        # what was queued before it has been applied, but a RequestJob{build}: it goes to the claim
        # batcher at once, saying how many of the worker's builds have ended in the reports still on
        # their way (those slots are free: the worker asks only for a free one), so a hand-out waits
        # for one commit, the claim's, not for the report batch's first.
        #
        # REPORT_ROUNDS_AHEAD rounds ahead at most: the reports queued before the RequestJob that many
        # requests back are applied before the next one goes. Without it a session's claims outran its
        # reports without bound whenever the report batches were the slower (300 workers on 60 000
        # builds: 58 000 reports queued after 20 s, their workers' next requests waiting up to 10 s
        # behind them, bench/handout.py); with it the claims wait for the reports, and the socket for
        # both (back-pressure).
        pending = self._pending  # receive adds to it too, while nothing waits in the inbox
        # The reports queued before each of the last RequestJobs (the oldest first), not yet settled.
        rounds: deque[set[asyncio.Future[Any]]] = deque()
        while self._inbox or pending:
            if not self._inbox:
                # Nothing more queued yet: wait for the reports' batch or the next message, whichever
                # comes first. A worker sends its RequestJob right after the JobCompleted that freed the
                # slot, as a frame of its own: waiting for the reports here would hold that RequestJob
                # behind the report batch's commit (about a third of the hand-out's time under load,
                # bench/handout.py). Settled before this task ends: a message arriving meanwhile is then
                # still seen above (receive starts no second task while this one runs).
                if not pending[-1][0].done() and await self._message_or_reports(pending[-1][0]):
                    continue
                if not pending[-1][0].done():
                    continue  # reports came meanwhile (receive queued them): wait for theirs as well
                if not await self._settle(session, pending):
                    self._inbox_room.set()
                    return
                continue
            handler, message, size = self._inbox[0]
            try:
                if self._pipelined(message):
                    self._queue_report(session, message)
                elif isinstance(message, RequestJob) and message.kind == "build":
                    if len(rounds) >= REPORT_ROUNDS_AHEAD:
                        behind = rounds.popleft()
                        older = [p for p in pending if p[0] in behind]
                        pending[:] = [p for p in pending if p[0] not in behind]
                        if older and not await self._settle(session, older):
                            return
                    if pending and not await self._settle_done(session, pending):
                        return
                    queued = {future for future, _ in pending}
                    for earlier in rounds:
                        queued -= earlier
                    rounds.append(queued)
                    if pending:
                        if await self._dispatch(handler, session, message, finishing=_finishing(pending)):
                            continue
                        # Unanswered: a report on its way may put a build back (a cancel, a failure
                        # requeued without spending an attempt); asked again once they are applied.
                        if not await self._settle(session, pending):
                            return
                    await self._dispatch(handler, session, message)
                else:
                    if pending and not await self._settle(session, pending):
                        return
                    await self._dispatch(handler, session, message)
            finally:
                self._inbox.popleft()
                self._inbox_bytes -= size
                if self._inbox_bytes <= INBOX_MAX_BYTES:
                    self._inbox_room.set()

    async def _message_or_reports(self, last: asyncio.Future[Any]) -> bool:
        """Wait until a message is queued (True) or `last`, the latest queued report, has its result
        (False; a session's reports are applied in the order they were queued, so the earlier ones have
        theirs too)."""
        arrival = self._arrival = self._loop.create_future()

        def wake(_: asyncio.Future[Any]) -> None:
            if not arrival.done():
                arrival.set_result(None)

        last.add_done_callback(wake)
        try:
            await arrival
        finally:
            self._arrival = None
            last.remove_done_callback(wake)
        return bool(self._inbox)

    @staticmethod
    def _pipelined(message: Message) -> bool:
        kind = type(message)
        return kind in _BATCHED_TYPES and not (kind is JobUpdate and _is_eval_result(message))

    async def _settle_done(
        self, session: SessionRef, pending: list[tuple[asyncio.Future[Any], Message]]
    ) -> bool:
        """_settle for the queued reports already applied; the others stay pending."""
        done: list[tuple[asyncio.Future[Any], Message]] = []
        left: list[tuple[asyncio.Future[Any], Message]] = []
        for p in pending:
            (done if p[0].done() else left).append(p)
        if not done:
            return not self.closing
        pending[:] = left
        return await self._settle(session, done)

    async def _settle(self, session: SessionRef, pending: list[tuple[asyncio.Future[Any], Message]]) -> bool:
        """Wait for the queued reports' results; a report that failed on our side ends the session as any
        failure of ours does (1011). False once the session is being closed."""
        futures, pending[:] = list(pending), []
        for future, message in futures:
            try:
                result = await future
                if isinstance(result, Failed):
                    raise result.error
            except Exception:
                log.exception("handling %s from worker %s failed", tag_of(type(message)), session.worker_id)
                await self._close(1011, "internal error")
                return False
        return not self.closing

    async def _drain_inbox(self) -> None:
        """The socket is gone: what the worker sent before it left is still applied (a JobCompleted
        just before a disconnect counts), within INBOX_DRAIN_SECS."""
        runner = getattr(self, "_runner", None)
        if runner is None or runner.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(runner), INBOX_DRAIN_SECS)
        except TimeoutError:
            log.warning("%s left %d messages unhandled", self._who(), len(self._inbox))
        except Exception:  # the runner's own failure is logged where it happened
            log.debug("the inbox of %s ended with an error", self._who(), exc_info=True)

    async def _wait_for_previous(self, worker_id: str) -> None:
        parsed = parse_uuid(worker_id)
        previous = _held.get(str(parsed)) if parsed is not None else None
        # Only a socket on its way out (closed by either side): a live one's worker gets its 496 at once.
        if previous is None or previous is self or (previous in _live and not previous.closing):
            return
        try:
            await asyncio.wait_for(previous._ended.wait(), RECONNECT_WAIT_SECS)
        except TimeoutError:
            log.info("the last session of worker %s is still being closed; the handshake goes on", worker_id)

    async def _handshake(self, message: InitConnection) -> None:
        self._cancel_handshake_timer()
        # Its InitConnection is in: never closed to make room from now on (admission.py), also while it
        # waits for its worker's previous socket to be closed.
        self.handshaking = True
        await self._wait_for_previous(message.worker_id)
        if message.protocol != PROTOCOL_VERSION:
            await self._reject(
                400, f"unsupported protocol {message.protocol}: this server speaks {PROTOCOL_VERSION}"
            )
            return
        try:
            # With every other handshake of this process in the same few milliseconds: one transaction
            # (dispatcher.open_sessions_batch); a fleet connecting at once is not a transaction each.
            handshakes = batcher_for(
                dispatcher.open_sessions_batch,
                HANDSHAKE_WINDOW_SECS,
                lanes.SESSIONS,
                max_batch=settings.GRADIENT_PROTO_HANDSHAKE_CONCURRENCY,
                loop=self._loop,
            )
            result = await handshakes.submit(
                self,
                services.SessionOpen(
                    worker_id=message.worker_id,
                    token=message.token,
                    capabilities=message.capabilities,
                    channel_name=self.channel_name,
                    session_id=uuid.uuid4(),
                ),
            )
        except Exception:
            log.exception("handshake of %s failed", self._peer())
            await self._close(1011, "internal error")
            return
        if isinstance(result, HandshakeRejected):
            await self._reject(result.code, result.reason)
            return
        self.session = result.session
        admission.forget(self)  # a worker now, no stranger: out of the admission's count at once
        _held[str(result.session.worker_id)] = self
        _start_flusher()
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

    async def _dispatch(
        self, handler: Handler, session: SessionRef, message: Message, finishing: int = 0
    ) -> bool:
        """Handle one message and send its replies; False only for a RequestJob{build} left unanswered."""
        self._note_seen(session)
        if isinstance(message, WorkerMetrics):  # the heartbeat: in memory, no database, no thread
            jobloop.worker_metrics(session=session, message=message)
            await self._renew_group(session)
            return True
        answered = True
        try:
            if self._pipelined(message):
                result = await _reports_batcher(self._loop).submit(session, message)
                if isinstance(result, Failed):
                    raise result.error
                replies: list[ServerMessage] = []
            elif isinstance(message, RequestJob) and message.kind == "build":
                claims = self._claims_batcher()
                request = dispatcher.BuildRequest(message, finishing)
                handed = await claims.submit(session, request)
                for _ in range(ASK_AGAIN_BATCHES):  # its claims lost to another process's: once more
                    if handed is not dispatcher.ASK_AGAIN:
                        break
                    handed = await claims.submit(session, request)
                replies = [handed] if isinstance(handed, AssignJob) else []
                answered = bool(replies)
            elif isinstance(message, RequestJobList):
                # With the other sessions' of the same few milliseconds (heartbeat fences): one transaction.
                replies = list(
                    await batcher_for(
                        dispatcher.job_lists_batch, OFFER_WINDOW_SECS, lanes.OFFERS, loop=self._loop
                    ).submit(session, message)
                )
            elif isinstance(message, WorkerCapabilities):
                # With the other sessions' of the same few milliseconds: one statement.
                await batcher_for(
                    dispatcher.capabilities_batch, CAPABILITIES_WINDOW_SECS, lanes.HOT, loop=self._loop
                ).submit(session, message)
                replies = []
            else:
                lane = (
                    lanes.OFFERS
                    if isinstance(message, OFFER_LANE)
                    else lanes.CLAIMS
                    if isinstance(message, RequestJob)
                    else lanes.HOT
                )
                replies = await lanes.run(lane, _handle, handler, session, message)
        except Exception:
            # Our failure, not the worker's: no 400. Close; the worker reconnects and its jobs requeue.
            log.exception("handling %s from worker %s failed", tag_of(type(message)), session.worker_id)
            await self._close(1011, "internal error")
            return True
        for reply in replies:
            await self._send(reply)
        if isinstance(message, WorkerCapabilities):
            self._build_slots = message.max_concurrent_builds
            self._offer_soon(session, message)
        return answered

    async def _renew_group(self, session: SessionRef) -> None:
        now = time.monotonic()
        if self.group and now - self._grouped_at >= GROUP_RENEW_SECS:
            # Failing here (Redis away) costs nothing: the next heartbeat tries again, and a lost channel
            # layer ends the session through __call__ anyway.
            try:
                await self.channel_layer.group_add(self.group, self.channel_name)
                self._grouped_at = now
            except Exception:
                log.warning("renewing the channel-layer group of worker %s failed", session.worker_id)

    def _claims_batcher(self) -> dispatcher.Batcher:
        return batcher_for(dispatcher.request_builds_batch, CLAIM_WINDOW_SECS, lanes.CLAIMS, loop=self._loop)

    def _offer_soon(self, session: SessionRef, message: WorkerCapabilities) -> None:
        """Trigger assignment after a WorkerCapabilities: the worker's offer delta, computed on the offer
        lane and sent when ready. One at a time per session; a trigger while one runs runs it again."""
        if self._offering is not None and not self._offering.done():
            self._offer_again = True
            return
        self._offering = asyncio.get_running_loop().create_task(self._offer(session, message))

    async def _offer(self, session: SessionRef, message: WorkerCapabilities) -> None:
        while True:
            self._offer_again = False
            try:
                # With the other sessions' of the same few milliseconds (a fleet connecting at once):
                # one transaction, the first offers of workers alike one statement.
                offers = await batcher_for(
                    dispatcher.offers_batch,
                    OFFER_WINDOW_SECS,
                    lanes.OFFERS,
                    loop=self._loop,
                    yield_to=self._claims_batcher(),
                    yield_secs=OFFER_YIELD_SECS,
                ).submit(session, message)
            except Exception:
                log.exception(
                    "offering jobs to worker %s failed; the next pass offers them", session.worker_id
                )
                return
            for frame in offers:  # encoded on the offers lane (dispatcher.offers_batch)
                if self.closing:
                    return
                await self._send_text(frame)
            if not self._offer_again or self.closing:
                return

    # --- pushes through the channel layer -------------------------------------------------------------

    async def worker_push(self, event: dict[str, Any]) -> None:
        if self.session is None or self.closing:
            return
        await self._send_text(event["frame"])

    async def worker_close(self, event: dict[str, Any]) -> None:
        if self.session is None or self.closing:
            return
        session_id = event.get("session_id")
        if session_id is not None and session_id != str(self.session.session_id):
            return
        await self._close(int(event["code"]), str(event.get("reason") or "closed by the server"))

    # --- closing --------------------------------------------------------------------------------------

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        self._disconnect_reason = str(message.get("reason") or "")
        await super().websocket_disconnect(message)

    async def disconnect(self, code: int) -> None:
        self._cancel_handshake_timer()
        admission.forget(self)
        _live.discard(self)
        await self._drain_inbox()
        session = getattr(self, "session", None)
        if session is not None and not self.closing and code not in (1000, 1001):
            # Not a close we asked for, nor the worker's own: the connection failed under the session
            # (the keepalive ping unanswered for ws_ping_timeout, the network, a crashed peer). Say so.
            why = getattr(self, "_disconnect_reason", "") or _DISCONNECT_CAUSES.get(code, "")
            log.warning(
                "the connection of worker %s ended with %s%s",
                session.worker_id,
                code,
                f" ({why})" if why else "",
            )
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
            await self._close_in_database(session, reason)
        finally:
            if _held.get(str(session.worker_id)) is self:
                _held.pop(str(session.worker_id), None)
            ended = getattr(self, "_ended", None)
            if ended is not None:
                ended.set()

    async def _close_in_database(self, session: SessionRef, reason: str) -> None:
        try:
            presence.forget(session.session_id)
            await lanes.run(lanes.SESSIONS, _close_session, session, reason)
        except (OperationalError, InterfaceError) as exc:
            log.warning(
                "closing the session of %s failed (%s); closing it again as soon as the database answers",
                session.worker_id,
                first_line(exc),
            )
            _remember_unclosed(session, reason)
            return
        except Exception:
            log.exception("closing the session of %s failed; the liveness pass will", session.worker_id)
            return
        log.info("worker %s disconnected: %s", session.worker_id, reason)

    async def _send(self, message: ServerMessage) -> None:
        await self._send_text(encode(message))

    async def _send_text(self, frame: str) -> None:
        """Send a frame; a peer that has left already (uvicorn's ClientDisconnected, an OSError) is no
        failure of ours: its disconnect ends the session."""
        frames = self._frames
        if frames is not None and not self._sends_waiting and frames.send_text_now(frame):
            return
        self._sends_waiting += 1  # until it is out, none goes past it through the direct path
        try:
            # What AsyncWebsocketConsumer.send(text_data=) does, without its two coroutine layers.
            await self.base_send({"type": "websocket.send", "text": frame})
        except OSError:
            log.info("%s left before a frame to it went out", self._who())
            self.closing = True
        except RuntimeError as exc:
            if not _closed_already(exc):
                raise
            # The transport closed the socket meanwhile (a later frame of the same read was no UTF-8:
            # 1007): what answered an earlier one has no socket to go to.
            log.info("%s: its socket was closed before a frame to it went out", self._who())
            self.closing = True
        finally:
            self._sends_waiting -= 1

    async def close(self, code: int | None = None, reason: str | None = None) -> None:
        try:
            await super().close(code=code, reason=reason)
        except OSError:  # the peer left first: nothing to close
            log.debug("%s left before its close went out", self._who())
        except RuntimeError as exc:
            if not _closed_already(exc):
                raise
            log.debug("%s: its socket was closed already", self._who())

    def _who(self) -> str:
        session = getattr(self, "session", None)
        return f"worker {session.worker_id}" if session is not None else self._peer()

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
        log.info("closing the connection of %s with %s: %s", self._who(), code, reason)
        await self.close(code=code)

    async def _refuse_busy(self) -> None:
        """Refused before the upgrade for load (every unauthenticated socket of the process is pending):
        HTTP 503 with Retry-After, "busy: try again" (protocol.md), never a status a worker may take as
        final. Where the server cannot answer an upgrade with a response of its own (no ASGI websocket
        denial response), the close before the upgrade is its HTTP 403."""
        if "websocket.http.response" not in self.scope.get("extensions", {}):
            await self.close()
            return
        await self.base_send(
            {
                "type": "websocket.http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"1")],
            }
        )
        await self.base_send({"type": "websocket.http.response.body", "body": BUSY_BODY})

    async def make_room(self) -> None:
        """Closed by admission.py for a newer socket: this one has not sent its InitConnection."""
        reason = admission.EVICTED_REASON
        code = admission.EVICTED_CODE
        await self._send_and_close(Reject(code=code, reason=reason), 4000 + code, f"rejected: {reason}")

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
