"""Two pass runners at once over one database (two beats, two servers) have no duplicate effect.

Two real processes run the passes back to back for a few seconds, started at the same instant, over
a database seeded with work for every pass: assignments abandoned by workers that are gone (the
abandoned-dispatch sweep and the worker-liveness pass both reach them), evaluations shown evaluating
on no worker (the watchdog), builds out of their backoff (the assignment pass), clusters past
retention. Afterwards SQL shows every effect happened exactly once, the processes' own counts add up to
the work seeded, PassState's runs match the runs that held the lease, and neither process raised.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from gradient.clusters.models import AttemptOutcome, ClusterJob, ClusterStatus
from gradient.records.models import RecordEntry
from gradient.recovery.models import PassState
from gradient.scheduling.models import (
    BuildAttempt,
    BuildAttemptOutcome,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchOutcome,
    Evaluation,
    EvaluationStatus,
)
from gradient.scheduling.services import graph
from gradient.workers.models import Worker, WorkerSession
from tests.factories import (
    ClusterAttemptFactory,
    ClusterJobFactory,
    ClusterMemberFactory,
    DerivationBuildFactory,
    EvaluationFactory,
    ProjectFactory,
    connected_worker,
)
from tests.scheduling_helpers import ask, drv
from tests.support.processes import ROOT, base_env

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LOST_EVALS = 12
LOST_BUILDS = 12
STALE_EVALS = 8
DUE_RETRIES = 10
OLD_CLUSTERS = 25
RUN_SECS = 6.0


@dataclass
class Seeded:
    lost_evals: list[Any]
    lost_eval_rows: list[Any]
    lost_build_rows: list[Any]
    stale_evals: list[Any]
    due_builds: list[Any]


@pytest.fixture
def runner_env() -> dict[str, str]:
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("needs PostgreSQL")
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return base_env(DATABASE_URL=url, REDIS_URL=settings.REDIS_URL or None)


def _seed() -> Seeded:
    project = ProjectFactory()
    long_ago = timezone.now() - timedelta(hours=2)
    # Evaluation jobs and builds handed out to workers whose server died with their sockets, 2 h ago.
    lost_evals = [EvaluationFactory(project=project) for _ in range(LOST_EVALS)]
    building = EvaluationFactory(project=project, status=EvaluationStatus.BUILDING)
    graph.ingest_eval_result(
        evaluation=building, derivations=[drv(f"lost-{i}") for i in range(LOST_BUILDS)], now=timezone.now()
    )
    eval_rows, build_rows = [], []
    for _ in range(3):
        worker = connected_worker([project], max_concurrent_builds=LOST_BUILDS)
        for _ in range(LOST_EVALS // 3):
            eval_rows.append(ask(worker.id, "flake"))
        for _ in range(LOST_BUILDS // 3):
            build_rows.append(ask(worker.id, "build"))
    assert all(eval_rows) and all(build_rows)
    WorkerSession.objects.update(closed_at=long_ago, close_reason="its server died")
    Worker.objects.update(last_seen=long_ago)
    DispatchedJob.objects.update(dispatched_at=long_ago)
    # One worker is connected (and idle), so the waiting pass parks nothing for want of one.
    connected_worker([project])
    # Evaluations shown evaluating on no worker for five minutes.
    stale = [EvaluationFactory(project=project) for _ in range(STALE_EVALS)]
    Evaluation.objects.filter(id__in=[e.id for e in stale]).update(
        status=EvaluationStatus.EVALUATING_FLAKE, updated_at=timezone.now() - timedelta(minutes=5)
    )
    # Builds whose retry backoff has passed.
    due = [
        DerivationBuildFactory(
            status=BuildStatus.FAILED_TRANSIENT, retry_at=timezone.now() - timedelta(seconds=5), attempts=1
        )
        for _ in range(DUE_RETRIES)
    ]
    # Finished clusters past the retention window.
    finished = timezone.now() - timedelta(days=settings.GRADIENT_RETENTION_DAYS + 10)
    for _ in range(OLD_CLUSTERS):
        cluster = ClusterJobFactory(status=ClusterStatus.COMPLETED, finished_at=finished)
        ClusterMemberFactory(cluster_job=cluster)
        ClusterAttemptFactory(cluster_job=cluster, finished_at=finished, outcome=AttemptOutcome.SUCCEEDED)
    return Seeded(
        lost_evals=lost_evals,
        lost_eval_rows=[r.assignment_id for r in eval_rows],
        lost_build_rows=[r.assignment_id for r in build_rows],
        stale_evals=stale,
        due_builds=due,
    )


def _run_two(env: dict[str, str], tmp_path: Path, mode: str) -> list[dict[str, Any]]:
    """Both runner processes, started at the same instant; every run either of them made."""
    start_at = time.time() + 3.0  # both have imported Django by then
    processes = []
    for i in range(2):
        out, err = open(tmp_path / f"runner-{i}.out", "wb"), open(tmp_path / f"runner-{i}.err", "wb")
        processes.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "tests.support.pass_runner", str(start_at), str(RUN_SECS), mode],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=err,
                ),
                out,
                err,
            )
        )
    runs: list[dict[str, Any]] = []
    for i, (process, out, err) in enumerate(processes):
        code = process.wait(timeout=120)
        out.close()
        err.close()
        errors = (tmp_path / f"runner-{i}.err").read_text()
        assert code == 0 and "Traceback" not in errors, errors[-5000:]
        runs += [json.loads(line) for line in (tmp_path / f"runner-{i}.out").read_text().splitlines()]
    return runs


def _total(runs: list[dict[str, Any]], name: str, key: str | None = None) -> int:
    results = [r["result"] for r in runs if r["pass"] == name and r["result"] is not None]
    return sum(r[key] if key else r for r in results)


def _facts(job_key: str, text: str) -> int:
    return RecordEntry.objects.filter(record__job_key=job_key, body__contains=text).count()


def _each_effect_happened_once(seeded: Seeded) -> None:
    # Every abandoned assignment closed once, as Abandoned; its job went back once.
    rows = DispatchedJob.objects.filter(id__in=seeded.lost_eval_rows + seeded.lost_build_rows)
    assert not rows.filter(finished_at__isnull=True).exists()
    assert set(rows.values_list("outcome", flat=True)) == {DispatchOutcome.ABANDONED}
    for row in DispatchedJob.objects.filter(id__in=seeded.lost_eval_rows):
        assert _facts(row.job_id, '"assignment_closed"') == 1, row.job_id
        assert _facts(row.job_id, '"lost"') == 1, row.job_id
    assert set(
        Evaluation.objects.filter(id__in=[e.id for e in seeded.lost_evals]).values_list(
            "lost_dispatches", flat=True
        )
    ) == {1}
    assert not BuildAttempt.objects.filter(outcome=BuildAttemptOutcome.RUNNING).exists()
    lost_builds = DerivationBuild.objects.filter(dispatches__id__in=seeded.lost_build_rows)
    assert set(lost_builds.values_list("status", flat=True)) == {BuildStatus.QUEUED}
    assert set(lost_builds.values_list("attempts", flat=True)) == {1}  # spent once, by the lost attempt
    # Every stale evaluation requeued once by the watchdog.
    for evaluation in seeded.stale_evals:
        assert _facts(evaluation.job_key, "watchdog: no worker holds its evaluation job") == 1
    # Every build out of its backoff queued (once: an UPDATE on its status).
    assert set(
        DerivationBuild.objects.filter(id__in=[b.id for b in seeded.due_builds]).values_list(
            "status", flat=True
        )
    ) == {BuildStatus.QUEUED}
    # Every old cluster deleted.
    assert not ClusterJob.objects.exists()


def test_two_runners_running_every_pass_at_once_have_each_effect_once(
    runner_env: dict[str, str], tmp_path: Path
) -> None:
    seeded = _seed()

    runs = _run_two(runner_env, tmp_path, "tasks")

    _each_effect_happened_once(seeded)
    # The runs that held the lease did the work once between them.
    assert _total(runs, "cluster-retention") == OLD_CLUSTERS
    assert _total(runs, "evaluation-watchdog") == STALE_EVALS
    assert _total(runs, "assignment", "promoted") == DUE_RETRIES
    # Every run that held the lease counted once, and every lease was given back, without an error.
    held = Counter(r["pass"] for r in runs if r["result"] is not None)
    skipped = Counter(r["pass"] for r in runs if r["result"] is None)
    states = {s.name: s for s in PassState.objects.all()}
    for name, count in held.items():
        assert states[name].runs == count, name
        assert states[name].lease_holder == "" and states[name].lease_expires_at is None
        assert states[name].last_error == ""
    # The two really ran at once: each was turned away by the other's lease at least once.
    assert sum(skipped.values()) > 0


def test_the_sweeps_retention_and_retries_have_each_effect_once_even_without_a_lease(
    runner_env: dict[str, str], tmp_path: Path
) -> None:
    """What an expired lease (a pass slower than its lease) or two passes reaching the same rows (the
    sweep and worker liveness) come to: every write is conditional, so the second finds nothing."""
    seeded = _seed()

    runs = _run_two(runner_env, tmp_path, "bodies")

    _each_effect_happened_once(seeded)
    assert _total(runs, "cluster-retention") == OLD_CLUSTERS
    assert _total(runs, "evaluation-watchdog") == STALE_EVALS
    assert _total(runs, "promote-retries") == DUE_RETRIES
    # The sweep and liveness share the abandoned assignments: liveness counts workers, the sweep rows.
    assert _total(runs, "abandoned-dispatch-sweep") <= LOST_EVALS + LOST_BUILDS
