"""Messages to workers, sent only once the transaction that decided them has committed.

Each worker's session listens on its own group of the channel layer, so a pass running in a Celery
worker or in another `serve` process reaches a worker connected anywhere.
"""

from __future__ import annotations

import uuid
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction


def worker_group(worker_id: uuid.UUID | str) -> str:
    return f"worker.{worker_id}"


def send_to_worker_now(worker_id: uuid.UUID | str, message: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    async_to_sync(layer.group_send)(worker_group(worker_id), {"type": "gradient.push", "message": message})


def send_to_worker_on_commit(worker_id: uuid.UUID | str, message: dict[str, Any]) -> None:
    transaction.on_commit(lambda: send_to_worker_now(worker_id, message))
