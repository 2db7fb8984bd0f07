"""Pushes to a connected worker, from any process, through the channel layer.

Every open session's consumer joins the group `worker_group(worker_id)`. A push is a group_send to
that group, so a pass running in a Celery worker or in another `serve` process reaches the worker
wherever it is connected (with REDIS_URL; the in-memory layer of embedded mode reaches this process,
which is the only one there). Messages whose rows a transaction writes go out from
`transaction.on_commit`: use the `*_on_commit` forms inside a transaction.

A push to a worker that is not connected is dropped, as the channel layer drops a group message with
no members.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.db import transaction

from gradient.core.protocol import ServerMessage, encode

log = logging.getLogger("gradient.workers")

# Channel-layer event types, dispatched by Channels to WorkerConsumer.worker_push / worker_close.
PUSH_EVENT = "worker.push"
CLOSE_EVENT = "worker.close"

# Close codes for sessions the server ends (Reject codes are 4000 + code; these are not Rejects).
CLOSE_DEACTIVATED = 4403
CLOSE_SILENT = 4408
CLOSE_SERVER_DRAINING = 1012  # "service restart": reconnect, probably elsewhere

_serve_loop: asyncio.AbstractEventLoop | None = None


def remember_serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Called by the consumer: the event loop that owns this process's sockets and in-memory layer."""
    global _serve_loop
    _serve_loop = loop


def worker_group(worker_id: uuid.UUID | str) -> str:
    """The channel-layer group of a worker's open session."""
    return f"worker.{uuid.UUID(str(worker_id)).hex}"


def push_to_worker(worker_id: uuid.UUID | str, message: ServerMessage) -> None:
    """Send `message` to the worker's open session now. Call from sync code outside a transaction (or
    use push_to_worker_on_commit)."""
    _group_send(worker_group(worker_id), {"type": PUSH_EVENT, "frame": encode(message)})


def push_to_worker_on_commit(worker_id: uuid.UUID | str, message: ServerMessage) -> None:
    """Send `message` once the current transaction commits (at once outside a transaction)."""
    transaction.on_commit(lambda: push_to_worker(worker_id, message))


def close_worker_session(
    worker_id: uuid.UUID | str, *, session_id: uuid.UUID | None, code: int, reason: str
) -> None:
    """Order the consumer holding the worker's socket to close it. With a session_id, only that session
    obeys (a newer session of the same worker is left alone)."""
    _group_send(
        worker_group(worker_id),
        {
            "type": CLOSE_EVENT,
            "session_id": str(session_id) if session_id is not None else None,
            "code": code,
            "reason": reason,
        },
    )


def close_worker_session_on_commit(
    worker_id: uuid.UUID | str, *, session_id: uuid.UUID | None, code: int, reason: str
) -> None:
    transaction.on_commit(
        lambda: close_worker_session(worker_id, session_id=session_id, code=code, reason=reason)
    )


_background: set[asyncio.Task[None]] = set()


def _group_send(group: str, event: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not None:  # called synchronously from async code: schedule it, never block the loop
        task = running.create_task(layer.group_send(group, event))
        _background.add(task)
        task.add_done_callback(_background.discard)
        return
    loop = _serve_loop
    try:
        if isinstance(layer, InMemoryChannelLayer) and loop is not None and loop.is_running():
            # The in-memory layer's queues belong to the serve loop; a send from another thread (the
            # in-process pass runner) must run there, or the waiting consumer is never woken.
            asyncio.run_coroutine_threadsafe(layer.group_send(group, event), loop).result(timeout=10)
        else:
            async_to_sync(layer.group_send)(group, event)
    except Exception:  # a push is best effort: the worker's liveness and the passes recover
        log.exception("push to %s failed", group)
