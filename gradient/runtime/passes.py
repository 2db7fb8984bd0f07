"""Running a periodic pass exactly once at a time, whoever runs it (Celery beat, the in-process runner,
two servers), and server boot bookkeeping."""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from gradient.recovery.models import PassState, ServerBoot
from gradient.runtime import metrics

log = logging.getLogger("gradient.passes")

T = TypeVar("T")


def pass_lease_acquire(*, name: str, holder: str, lease_secs: float, now: datetime) -> bool:
    """Take the pass's lease if it is free or expired. One conditional UPDATE decides the winner."""
    try:
        with transaction.atomic():
            PassState.objects.get_or_create(name=name)
    except IntegrityError:
        pass  # another runner created the row first; the UPDATE below arbitrates
    won = (
        PassState.objects.filter(name=name)
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now))
        .update(
            lease_holder=holder, lease_expires_at=now + timedelta(seconds=lease_secs), last_started_at=now
        )
    )
    return won == 1


def pass_lease_release(
    *, name: str, holder: str, started: float, result: Any, error: str, now: datetime
) -> None:
    duration_ms = (time.monotonic() - started) * 1000
    metrics.observe(metrics.PASS_DURATION, duration_ms / 1000, {"pass": name}, metrics.PASS_BUCKETS)
    PassState.objects.filter(name=name, lease_holder=holder).update(
        lease_holder="",
        lease_expires_at=None,
        last_finished_at=now,
        last_duration_ms=duration_ms,
        last_result=result,
        last_error=error,
        runs=F("runs") + 1,
    )


def pass_leases_release_held_by(*, processes: list[tuple[str, int]], now: datetime) -> int:
    """Free the unexpired leases held by these (hostname, pid) processes, which are gone: a `serve`
    SIGKILLed while running the cluster-dispatch kick would otherwise hold that pass for the rest of
    its lease. Returns how many were freed."""
    held_by = Q()
    for hostname, pid in processes:
        held_by |= Q(lease_holder__startswith=f"{hostname}:{pid}:")
    if not processes:
        return 0
    return PassState.objects.filter(held_by, lease_expires_at__gt=now).update(
        lease_holder="", lease_expires_at=None
    )


def pass_run(*, name: str, body: Callable[[], T], lease_secs: float = 600.0) -> T | None:
    """Run `body` under the pass's lease. Returns its result, or None when another runner holds it."""
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    if not pass_lease_acquire(name=name, holder=holder, lease_secs=lease_secs, now=timezone.now()):
        log.debug("pass %s: another runner holds the lease", name)
        return None
    started = time.monotonic()
    result: T | None = None
    error = ""
    try:
        result = body()
        return result
    except Exception:
        error = traceback.format_exc()
        log.exception("pass %s failed", name)
        raise
    finally:
        pass_lease_release(
            name=name,
            holder=holder,
            started=started,
            result=_jsonable(result),
            error=error,
            now=timezone.now(),
        )


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def server_boot_start(*, now: datetime) -> ServerBoot:
    return ServerBoot.objects.create(
        hostname=socket.gethostname(), pid=os.getpid(), started_at=now, last_heartbeat=now
    )


def server_boot_heartbeat(*, boot_id: uuid.UUID, now: datetime) -> None:
    ServerBoot.objects.filter(id=boot_id, stopped_at__isnull=True).update(last_heartbeat=now)


def server_boot_stop(*, boot_id: uuid.UUID, now: datetime) -> None:
    ServerBoot.objects.filter(id=boot_id, stopped_at__isnull=True).update(stopped_at=now, last_heartbeat=now)


def server_boot_drain(*, boot_id: uuid.UUID, now: datetime) -> bool:
    """The instance began draining: from now on it takes no new work, and when no other instance serves,
    the waiting pass parks every in-flight evaluation as `draining`."""
    return (
        ServerBoot.objects.filter(id=boot_id, stopped_at__isnull=True, draining_since__isnull=True).update(
            draining_since=now, last_heartbeat=now
        )
        == 1
    )
