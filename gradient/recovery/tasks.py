"""Periodic passes of the recovery app: thin tasks that call services under a lease."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from gradient.recovery.sweeps import abandoned_dispatch_sweep, evaluation_watchdog
from gradient.runtime.passes import pass_run


@shared_task(name="gradient.recovery.tasks.abandoned_dispatch_sweep")
def abandoned_dispatch_sweep_pass() -> int | None:
    return pass_run(
        name="abandoned-dispatch-sweep", body=lambda: abandoned_dispatch_sweep(now=timezone.now())
    )


@shared_task(name="gradient.recovery.tasks.evaluation_watchdog")
def evaluation_watchdog_pass() -> int | None:
    return pass_run(name="evaluation-watchdog", body=lambda: evaluation_watchdog(now=timezone.now()))
