"""Every periodic pass, declared once.

Celery beat (through django-celery-beat's DatabaseScheduler) and the in-process runner of embedded
mode both read PASSES. Each entry's `expires` is just under its interval, so a backlog of runs that
could not start in time is dropped instead of piling up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings


@dataclass(frozen=True)
class PassSpec:
    name: str
    task: str  # the Celery task's registered name
    interval: Callable[[], float]  # seconds, read from settings when the schedule is built

    def seconds(self) -> float:
        return float(self.interval())


def _pass_interval() -> float:
    return float(settings.GRADIENT_SCHEDULER_PASS_INTERVAL_SECS)


def _worker_liveness_interval() -> float:
    """Every max(5, timeout / 3) s; disabled (0) with a heartbeat timeout of 0."""
    timeout = float(settings.GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS)
    return 0.0 if timeout <= 0 else max(5.0, timeout / 3)


PASSES: tuple[PassSpec, ...] = (
    PassSpec("assignment", "gradient.scheduling.tasks.assignment_pass", _pass_interval),
    PassSpec("build-resync", "gradient.scheduling.tasks.build_resync_pass", lambda: 60.0),
    PassSpec("graph-reheal", "gradient.scheduling.tasks.graph_reheal_pass", lambda: 300.0),
    PassSpec("cluster-retention", "gradient.clusters.tasks.retention_pass", lambda: 3600.0),
    PassSpec("abandoned-dispatch-sweep", "gradient.recovery.tasks.abandoned_dispatch_sweep", lambda: 60.0),
    PassSpec("evaluation-watchdog", "gradient.recovery.tasks.evaluation_watchdog", lambda: 60.0),
    PassSpec("records-check", "gradient.records.tasks.check_pass", lambda: 300.0),
    PassSpec("worker-liveness", "gradient.workers.tasks.worker_liveness_pass", _worker_liveness_interval),
    PassSpec("cluster-dispatch", "gradient.clusters.tasks.dispatch_pass", _pass_interval),
    PassSpec("build-log-seal", "gradient.scheduling.tasks.build_log_seal_pass", _pass_interval),
    PassSpec(
        "eta", "gradient.scheduling.tasks.eta_pass", lambda: float(settings.GRADIENT_ETA_PASS_INTERVAL_SECS)
    ),
)


def beat_schedule() -> dict[str, dict[str, Any]]:
    schedule: dict[str, dict[str, Any]] = {}
    for spec in PASSES:
        seconds = spec.seconds()
        if seconds <= 0:  # disabled by configuration (e.g. a heartbeat timeout of 0)
            continue
        expires = max(1.0, seconds * 0.9)
        schedule[spec.name] = {
            "task": spec.task,
            "schedule": seconds,
            # `expires` is Celery's own option; django-celery-beat's DatabaseScheduler drops it when it
            # installs the entry and keeps only `expire_seconds` (a whole number of seconds, its column).
            "options": {"expires": expires, "expire_seconds": max(1, int(expires))},
        }
    return schedule
