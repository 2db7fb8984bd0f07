"""Periodic passes of the scheduling app: thin tasks that call services under a lease."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from celery import shared_task
from django.utils import timezone

from gradient.runtime.passes import pass_run
from gradient.scheduling.services.estimates import start_estimate_pass
from gradient.scheduling.services.logs import build_log_seal_pass as run_build_log_seal
from gradient.scheduling.services.passes import assignment_pass as run_assignment_pass
from gradient.scheduling.services.passes import build_resync_pass as run_build_resync
from gradient.scheduling.services.waiting import reheal_pass


@shared_task(name="gradient.scheduling.tasks.assignment_pass")
def assignment_pass() -> dict[str, Any] | None:
    return pass_run(
        name="assignment", body=lambda: asdict(run_assignment_pass(now=timezone.now())), lease_secs=60
    )


@shared_task(name="gradient.scheduling.tasks.build_resync_pass")
def build_resync_pass() -> int | None:
    return pass_run(name="build-resync", body=lambda: run_build_resync(now=timezone.now()), lease_secs=120)


@shared_task(name="gradient.scheduling.tasks.graph_reheal_pass")
def graph_reheal_pass() -> int | None:
    """Every 300 s (graphConsistencyIntervalSecs): the heal again for each graph_stuck evaluation."""
    return pass_run(name="graph-reheal", body=lambda: reheal_pass(now=timezone.now()), lease_secs=600)


@shared_task(name="gradient.scheduling.tasks.build_log_seal_pass")
def build_log_seal_pass() -> int | None:
    """Every pass interval: the logs of closed assignments stored as one compressed blob each."""
    return pass_run(
        name="build-log-seal", body=lambda: run_build_log_seal(now=timezone.now()), lease_secs=300
    )


@shared_task(name="gradient.scheduling.tasks.eta_pass")
def eta_pass() -> dict[str, Any] | None:
    """Every GRADIENT_ETA_PASS_INTERVAL_SECS: newly waiting builds' and evaluations' expected start
    written down, and the started ones' error settled (services.estimates)."""
    return pass_run(
        name="eta", body=lambda: start_estimate_pass(now=timezone.now()).as_dict(), lease_secs=120
    )
