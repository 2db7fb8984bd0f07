"""claim_cluster racing single claims of the same jobs, in two real processes with their own database
connections, for 1 000 rounds; the invariants are checked with SQL afterwards (cluster-jobs.md, Claim:
idx-cluster_attempt-open and idx-dispatched_job-open-job arbitrate, the first statement that inserts
nothing rolls the whole attempt back)."""

from __future__ import annotations

import multiprocessing
import random
import time
import traceback
import uuid
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models import F
from django.utils import timezone

from gradient.clusters.decisions.types import Placement, Seat, SlotKind
from gradient.clusters.services.attempts import claim_cluster
from gradient.scheduling import history
from gradient.scheduling.models import BuildStatus, DerivationBuild, EvaluationStatus, JobKind
from gradient.scheduling.services.claims import ClaimRequest, claim_assignment
from gradient.workers.models import IdleSlot
from tests.clusters_helpers import make_cluster, queued_evaluation
from tests.factories import DerivationBuildFactory, ProjectFactory, connected_worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("postgres_only")]

ROUNDS = 1000
BARRIER_TIMEOUT = 60.0
HEAD_STARTS = (0.0, 0.0, 0.0, 0.001, 0.003, 0.03)
"""Each side waits one of these after the barrier: mostly both start at once and their transactions
overlap; now and then one side is well ahead, so each side wins rounds whatever the machine's load."""

Round = dict[str, Any]


class _Lost(Exception):
    pass


def _single_claim(job: dict[str, str], worker_id: uuid.UUID) -> bool:
    """What single assignment does: the claim and the job's own transition, together or not at all."""
    now = timezone.now()
    try:
        with transaction.atomic():
            if job["kind"] == JobKind.BUILD:
                request = ClaimRequest(
                    kind=JobKind.BUILD, job_key=job["key"], worker_id=worker_id, build_id=uuid.UUID(job["id"])
                )
            else:
                request = ClaimRequest(
                    kind=JobKind.EVAL,
                    job_key=job["key"],
                    worker_id=worker_id,
                    evaluation_id=uuid.UUID(job["id"]),
                )
            if claim_assignment(request=request, now=now) is None:
                return False
            if job["kind"] == JobKind.BUILD:
                changed = DerivationBuild.objects.filter(id=job["id"], status=BuildStatus.QUEUED).update(
                    status=BuildStatus.BUILDING, attempts=F("attempts") + 1
                )
                if changed != 1:
                    raise _Lost
            elif not history.evaluation_transition(
                evaluation_id=uuid.UUID(job["id"]),
                to=EvaluationStatus.EVALUATING_FLAKE,
                expect=[EvaluationStatus.QUEUED],
                reason="single claim",
                now=now,
            ):
                raise _Lost
            return True
    except _Lost:
        return False


def _cluster_side(rounds: list[Round], barrier: Any, results: Any) -> None:
    try:
        won = []
        rng = random.Random(1)
        for r in rounds:
            now = timezone.now()
            for worker_id, kind in ((r["build_worker"], "build"), (r["eval_worker"], "eval")):
                IdleSlot.objects.update_or_create(
                    worker_id=worker_id, kind=kind, defaults={"recorded_at": now}
                )
            barrier.wait(BARRIER_TIMEOUT)
            time.sleep(rng.choice(HEAD_STARTS))
            won.append(claim_cluster(placement=r["placement"], now=timezone.now()) is not None)
        results.put(("cluster", won, None))
    except Exception:
        results.put(("cluster", None, traceback.format_exc()))
    finally:
        connections.close_all()


def _single_side(rounds: list[Round], barrier: Any, results: Any) -> None:
    try:
        won = []
        rng = random.Random(2)
        for r in rounds:
            jobs = list(r["jobs"])
            rng.shuffle(jobs)
            barrier.wait(BARRIER_TIMEOUT)
            time.sleep(rng.choice(HEAD_STARTS))
            won.append(sorted(j["key"] for j in jobs if _single_claim(j, r["single_worker"])))
        results.put(("single", won, None))
    except Exception:
        results.put(("single", None, traceback.format_exc()))
    finally:
        connections.close_all()


def _rounds() -> list[Round]:
    project = ProjectFactory()
    build_worker = connected_worker([project])
    eval_worker = connected_worker([project])
    single_worker = connected_worker([project])
    rounds = []
    for _ in range(ROUNDS):
        build = DerivationBuildFactory(status=BuildStatus.QUEUED, queued_at=timezone.now())
        evaluation = queued_evaluation(project)
        cluster = make_cluster([("builder", build), ("evaluator", evaluation)])
        seats = (
            Seat("builder", 0, build.job_key, SlotKind.BUILD, str(build_worker.id)),
            Seat("evaluator", 0, evaluation.job_key, SlotKind.EVAL, str(eval_worker.id)),
        )
        rounds.append(
            {
                "cluster": str(cluster.id),
                "placement": Placement(cluster_id=str(cluster.id), seats=seats, cost=0),
                "jobs": [
                    {"kind": JobKind.BUILD, "key": build.job_key, "id": str(build.id)},
                    {"kind": JobKind.EVAL, "key": evaluation.job_key, "id": str(evaluation.id)},
                ],
                "build_worker": build_worker.id,
                "eval_worker": eval_worker.id,
                "single_worker": single_worker.id,
            }
        )
    return rounds


def _rows(sql: str) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return list(cursor.fetchall())


def test_claim_cluster_racing_single_claims_in_two_processes_keeps_every_invariant() -> None:
    rounds = _rounds()
    connections.close_all()  # the children open their own connections; nothing is shared over the fork
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    results = context.Queue()
    processes = [
        context.Process(target=_cluster_side, args=(rounds, barrier, results)),
        context.Process(target=_single_side, args=(rounds, barrier, results)),
    ]
    for p in processes:
        p.start()
    outcome = {}
    for _ in processes:
        side, won, error = results.get(timeout=600)
        assert error is None, f"{side} side failed (a deadlock is an error too):\n{error}"
        outcome[side] = won
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0

    # Each round has exactly one winner: the whole cluster, or the single claims of both its jobs.
    cluster_won, single_won = outcome["cluster"], outcome["single"]
    for r, by_cluster, by_single in zip(rounds, cluster_won, single_won, strict=True):
        expected = [] if by_cluster else sorted(j["key"] for j in r["jobs"])
        assert by_single == expected, (r["cluster"], by_cluster, by_single)
    print(f"claim_cluster won {sum(cluster_won)} of {ROUNDS} rounds; single claims won the rest")
    assert 0 < sum(cluster_won) < ROUNDS, "both sides should win some rounds for the race to mean anything"

    # At most one open attempt per cluster.
    assert (
        _rows(
            "SELECT cluster_job_id FROM cluster_attempt WHERE finished_at IS NULL"
            " GROUP BY 1 HAVING count(*) > 1"
        )
        == []
    )
    # Every attempt has all its member rows (and seats), or none: a lost claim left no attempt behind.
    assert (
        _rows(
            """
        SELECT a.id FROM cluster_attempt a
        WHERE (SELECT count(*) FROM dispatched_job d WHERE d.cluster_attempt_id = a.id)
              <> (SELECT count(*) FROM cluster_member m WHERE m.cluster_job_id = a.cluster_job_id)
           OR (SELECT count(*) FROM cluster_seat s WHERE s.attempt_id = a.id)
              <> (SELECT count(*) FROM cluster_member m WHERE m.cluster_job_id = a.cluster_job_id)
        """
        )
        == []
    )
    assert _rows("SELECT count(*) FROM cluster_attempt")[0][0] == sum(cluster_won)
    # No job is open both as a single job and as a member, nor twice.
    assert (
        _rows("SELECT job_id FROM dispatched_job WHERE finished_at IS NULL GROUP BY 1 HAVING count(*) > 1")
        == []
    )
    assert (
        _rows(
            """
        SELECT m.id FROM cluster_member m
        JOIN cluster_attempt a ON a.cluster_job_id = m.cluster_job_id AND a.finished_at IS NULL
        JOIN dispatched_job d ON d.finished_at IS NULL AND d.job_id = CASE
            WHEN m.evaluation_id IS NOT NULL THEN 'eval:' || m.evaluation_id::text
            ELSE 'build:' || m.derivation_build_id::text END
        WHERE d.cluster_attempt_id IS DISTINCT FROM a.id
        """
        )
        == []
    )
    # Every job was handed out exactly once, and its own transition happened exactly once.
    assert _rows("SELECT count(*) FROM dispatched_job WHERE finished_at IS NULL")[0][0] == 2 * ROUNDS
    assert (
        _rows("SELECT count(*) FROM derivation_build WHERE status = 'Building' AND attempts = 1")[0][0]
        == ROUNDS
    )
    assert (
        _rows("SELECT count(*) FROM evaluation WHERE status IN ('Fetching', 'EvaluatingFlake')")[0][0]
        == ROUNDS
    )
