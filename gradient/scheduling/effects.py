"""Messages from the scheduler to workers, sent only once the transaction that decided them has
committed, through gradient.runtime.outbox (a pass in a Celery worker or another `serve` reaches a
worker connected anywhere). The scheduler builds plain dicts with the protocol's names; they are
checked against the strict server-message schema here, on their way out."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from gradient.core.protocol import ServerMessage, decode_server_message
from gradient.runtime.outbox import push_to_worker, push_to_worker_on_commit, worker_group

__all__ = ["send_to_worker_now", "send_to_worker_on_commit", "to_server_message", "worker_group"]


def to_server_message(message: dict[str, Any]) -> ServerMessage:
    return decode_server_message(msgspec.json.encode(message))


def send_to_worker_now(worker_id: uuid.UUID | str, message: dict[str, Any]) -> None:
    push_to_worker(worker_id, to_server_message(message))


def send_to_worker_on_commit(worker_id: uuid.UUID | str, message: dict[str, Any]) -> None:
    push_to_worker_on_commit(worker_id, to_server_message(message))
