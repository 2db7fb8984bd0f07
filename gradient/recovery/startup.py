"""Startup recovery (recover_interrupted_work), run by `serve` before it accepts connections.

A server that crashed left rows claiming work that nobody is doing: assignments on workers whose
socket died with it, running build attempts, Building shared builds, evaluations being evaluated,
cluster attempts. The steps of waiting-and-recovery.md put them back, in order. Several `serve`
processes may share the database, so only what belonged to a dead server boot is touched: a worker
still connected to a live server keeps its jobs.

No live effects: nothing is pushed to workers from here (step 7); the rows are consistent on their own.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psutil
from django.db.models import Q
from django.utils import timezone

from gradient.clusters.services import recover_clusters_at_startup
from gradient.recovery.models import ServerBoot
from gradient.runtime import metrics
from gradient.runtime.instances import DEAD_BOOT_SECS
from gradient.runtime.passes import pass_leases_release_held_by
from gradient.scheduling.models import (
    DispatchedJob,
)
from gradient.scheduling.services import lifecycle
from gradient.scheduling.services.offers import forget_worker_offers
from gradient.workers.models import WorkerSession
from gradient.workers.services import sessions_of_boots_close

log = logging.getLogger("gradient.recovery")

# A live process on a boot's pid that was created this long after the boot started is another process
# (the pid was reused). Generous: process start times are read against a wall clock that may have moved.
PID_REUSE_SLACK_SECS = 60


@dataclass
class RecoveryReport:
    dead_boots: int = 0
    sessions_closed: int = 0
    assignments_closed: int = 0
    build_attempts_aborted: int = 0
    builds_requeued: int = 0
    builds_unpromoted: int = 0
    evaluations_requeued: int = 0
    pass_leases_released: int = 0
    clusters: dict[str, Any] = field(default_factory=dict)
    draining_unparked: int = 0


def boot_process_gone(boot: ServerBoot) -> bool:
    """Whether the process of a boot on this host is gone. Its heartbeat says nothing yet when it was
    SIGKILLed seconds ago, so the process table decides: no such pid; a zombie (killed, not yet reaped by
    its parent); this very process (a restarted container gets the same pid again); or a process that
    started well after the boot did (the pid was reused)."""
    if boot.pid == os.getpid():
        return True  # the current boot is excluded by id: this is an earlier process with our pid
    try:
        process = psutil.Process(boot.pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        created = process.create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False  # someone else's live process: leave the boot to its heartbeat
    return created > boot.started_at.timestamp() + PID_REUSE_SLACK_SECS


def dead_boot_ids(*, current: uuid.UUID, now: datetime) -> list[uuid.UUID]:
    """Boots that are gone: stopped, silent for DEAD_BOOT_SECS, or on this host with their process gone."""
    host = socket.gethostname()
    dead: list[uuid.UUID] = []
    for boot in ServerBoot.objects.exclude(id=current).filter(
        Q(stopped_at__isnull=True) | Q(stopped_at__gte=now - timedelta(days=1))
    ):
        if (
            boot.stopped_at is not None
            or boot.last_heartbeat < now - timedelta(seconds=DEAD_BOOT_SECS)
            or (boot.hostname == host and boot_process_gone(boot))
        ):
            dead.append(boot.id)
    return dead


def _live_workers(dead: list[uuid.UUID]) -> Any:
    """Workers whose open session is held by a live server."""
    return (
        WorkerSession.objects.filter(closed_at__isnull=True).exclude(server_boot__in=dead).values("worker_id")
    )


RESTART_REASON = "server restarted"
EVAL_RESTART_REASON = "server restarted while its evaluation job was on a worker"


def recover_interrupted_work(*, boot_id: uuid.UUID, now: datetime) -> RecoveryReport:
    report = RecoveryReport()
    dead = dead_boot_ids(current=boot_id, now=now)
    report.dead_boots = len(dead)
    # Pass leases held by a crashed process on this host are free now (the cluster-dispatch kick runs in
    # serve): else that pass would wait for the rest of the lease.
    crashed = [
        (b.hostname, b.pid)
        for b in ServerBoot.objects.filter(
            id__in=dead, stopped_at__isnull=True, hostname=socket.gethostname()
        )
        if b.pid != os.getpid() and boot_process_gone(b)
    ]
    ServerBoot.objects.filter(id__in=dead, stopped_at__isnull=True).update(stopped_at=now)
    report.pass_leases_released = pass_leases_release_held_by(processes=crashed, now=now)

    # Sessions held by dead servers are gone with their sockets; their jobs are recovered below, step by
    # step, instead of by the session hooks.
    orphaned_workers = sessions_of_boots_close(boot_ids=dead, reason="its server stopped", now=now)
    report.sessions_closed = len(orphaned_workers)
    for worker_id in set(orphaned_workers):
        forget_worker_offers(worker_id)

    live = _live_workers(dead)

    # 1. Assignments: open single-job rows on workers no live server holds close as Abandoned. Cluster
    #    members are left to the cluster steps (5). An evaluation's own step 4 is taken in the same
    #    transaction as its close: the passes keep running meanwhile (Celery beat, other servers), and a
    #    waiting pass that saw it Fetching without an assignment would park it instead of it being requeued.
    for row in DispatchedJob.objects.filter(finished_at__isnull=True, cluster_attempt__isnull=True).exclude(
        worker_id__in=live
    ):
        closed, requeued = lifecycle.abandon_assignment(
            row, reason=RESTART_REASON, now=now, evaluation_reason=EVAL_RESTART_REASON
        )
        report.assignments_closed += int(closed)
        report.evaluations_requeued += int(requeued)

    # 2. Running build attempts without an open assignment turn Aborted. 3. Building shared builds
    #    without an open assignment turn Queued first; unpromote_ungated then moves those whose
    #    dependencies are not all done back to Created.
    builds = lifecycle.requeue_stranded_builds(reason=RESTART_REASON, now=now)
    report.build_attempts_aborted = builds.attempts_aborted
    report.builds_requeued = builds.requeued
    report.builds_unpromoted = builds.unpromoted

    # 4. Evaluations being fetched or evaluated on a worker that is gone turn Queued, with a phase event.
    report.evaluations_requeued += lifecycle.requeue_stranded_evaluations(reason=EVAL_RESTART_REASON, now=now)

    # 5. Clusters, in the reference notes' order: open attempts close (PrepareFailed unstarted, Aborted
    #    started), Running clusters go back to Queued, or to Aborted/Failed when a member is dead or the
    #    budget is spent. An attempt whose every seat is on a live server's worker is left to it.
    live_ids = list(
        WorkerSession.objects.filter(closed_at__isnull=True)
        .exclude(server_boot__in=dead)
        .values_list("worker_id", flat=True)
    )
    report.clusters = asdict(recover_clusters_at_startup(now=now, live_worker_ids=live_ids))
    return report


def run_startup_recovery(*, boot_id: uuid.UUID) -> RecoveryReport:
    """Recover, mark the boot recovered, then unpark the evaluations an earlier drain parked
    (unpark_draining_evals): recovery first, so they come back onto consistent rows."""
    from gradient.scheduling.services.waiting import unpark_draining_evals

    now = timezone.now()
    report = recover_interrupted_work(boot_id=boot_id, now=now)
    ServerBoot.objects.filter(id=boot_id).update(recovered_at=timezone.now())
    report.draining_unparked = unpark_draining_evals(now=timezone.now())
    folded = metrics.compact()  # the /metrics totals of earlier processes, one row each
    log.info("startup recovery for boot %s: %s; %d metric rows folded", boot_id, asdict(report), folded)
    return report
