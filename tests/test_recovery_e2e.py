"""End to end: SIGKILL `serve` while single jobs are assigned, an evaluation is being evaluated and a
cluster attempt is running; a new boot on the same port recovers what the dead boot left open, and the
same reference-worker processes reconnect by themselves and finish the work.

The workers are paused (SIGSTOP) across the restart so the rows can be read exactly as startup
recovery left them, before any worker reconnects and claims them again; resumed, each finds its socket
dead, abandons its jobs and reconnects with its own backoff.
"""

from __future__ import annotations

import signal
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from gradient.clusters.models import AttemptOutcome, ClusterAttempt, ClusterJob, ClusterStatus
from gradient.records.models import RecordEntry
from gradient.records.services import record_check_one
from gradient.recovery.models import ServerBoot
from gradient.recovery.startup import DEAD_BOOT_SECS
from gradient.scheduling.models import (
    EVALUATION_EVALUATING,
    BuildAttempt,
    BuildAttemptOutcome,
    BuildStatus,
    DerivationBuild,
    DispatchedJob,
    DispatchOutcome,
    Evaluation,
    EvaluationBuild,
    EvaluationStatus,
)
from gradient.workers.models import WorkerSession
from tests.support.processes import (
    ServeProcess,
    WorkerProcess,
    base_env,
    celery_worker,
    database_env,
    http_json,
    operator_token,
    reference_worker,
    serve,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FAST = ["--heartbeat-secs", "2", "--idle-request-secs", "1", "--cpu-core-score", "800"]


@pytest.fixture
def service_env() -> dict[str, str]:
    return database_env(GRADIENT_SCHEDULER_PASS_INTERVAL_SECS="1")


def _post(base: str, path: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    status, answer = http_json("POST", f"{base}{path}", body, token)
    assert status == 201, answer
    return answer  # type: ignore[no-any-return]


def _status(evaluation_id: str) -> str:
    return str(Evaluation.objects.get(id=evaluation_id).status)


def _records_agree_with_rows(job_keys: list[str]) -> None:
    for job_key in job_keys:
        problems, _ = record_check_one(job_key=job_key, now=timezone.now(), settle=False)
        assert problems == (), (job_key, problems)


def _dump(server: ServeProcess | None, workers: list[WorkerProcess]) -> None:
    for w in workers:
        print(f"--- {w.name}\n{w.log()[-3000:]}")
    if server is not None:
        print(f"--- serve\n{server.log()[-8000:]}")
    for cluster in ClusterJob.objects.all():
        print("cluster", cluster.status, cluster.attempts, cluster.waiting_reason, cluster.prepare_failures)
    for row in DispatchedJob.objects.order_by("dispatched_at"):
        print("row", row.job_id, row.worker_id, row.dispatched_at, row.finished_at, row.outcome, row.reason)
    for e in Evaluation.objects.all():
        print("evaluation", e.id, e.repository, e.status, e.waiting_reason)


def test_a_killed_server_is_recovered_by_the_next_boot_and_the_same_workers_finish_the_work(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    workers: list[WorkerProcess] = []
    first: ServeProcess | None = None
    with ExitStack() as stack:
        # The passes (cluster dispatch, assignment, waiting) on Celery beat, as in service mode; they keep
        # running across the restart.
        beat = stack.enter_context(celery_worker(service_env, tmp_path))
        first = stack.enter_context(serve(service_env, tmp_path))
        port, base, ws_url = first.port, first.base_url, first.ws_url
        token = operator_token(first)
        _post(base, "/api/v1/projects", {"name": "demo"}, token)
        ids = {
            name: _post(base, "/api/v1/workers", {"name": name, "projects": ["demo"]}, token)
            for name in ("evaluator", "w0", "w1", "w2")
        }

        def start(name: str, *args: str) -> WorkerProcess:
            worker = stack.enter_context(
                reference_worker(
                    ws_url,
                    str(ids[name]["id"]),
                    str(ids[name]["token"]),
                    tmp_path,
                    name=name,
                    extra_args=[*FAST, "--arch", "x86_64-linux", *args],
                    env=base_env(),
                )
            )
            workers.append(worker)
            return worker

        def submit(url: str) -> str:
            body = {"project": "demo", "repository": url, "commit": "1"}
            return str(_post(base, "/api/v1/evaluations", body, token)["id"])

        try:
            # The cluster's two builds: evaluated while no worker can build, so they stay Queued until the
            # cluster takes them (a cluster member is never a single job).
            start("evaluator", "--capabilities", "fetch,eval")
            pair = submit("sim:wide?n=2&duration_ms=4000&salt=pair")
            # Evaluated: Building, or already parked Waiting by the waiting pass (no worker can build yet).
            evaluated = (EvaluationStatus.BUILDING, EvaluationStatus.WAITING)
            # (Waiting alone is not enough: before the evaluator connects it waits for an eval worker.)
            wait_until(
                lambda: (
                    _status(pair) in evaluated
                    and EvaluationBuild.objects.filter(evaluation_id=pair).count() == 2
                ),
                timeout=30,
                what="pair evaluated",
            )
            pair_builds = [
                str(b)
                for b in EvaluationBuild.objects.filter(evaluation_id=pair).values_list("build_id", flat=True)
            ]
            assert len(pair_builds) == 2
            cluster_id = _post(
                base,
                "/api/v1/clusters",
                {"members": [{"build": b, "role": "node"} for b in pair_builds], "retry_budget": 2},
                token,
            )["id"]
            chain = submit("sim:chain?n=2&duration_ms=4000")
            slow_eval = submit("sim:diamond?eval_ms=6000&duration_ms=300")
            for name in ("w0", "w1", "w2"):
                start(name, "--slots", "2")

            def busy_everywhere() -> bool:
                cluster = ClusterJob.objects.get(id=cluster_id)
                chain_building = DispatchedJob.objects.filter(
                    finished_at__isnull=True,
                    cluster_attempt__isnull=True,
                    derivation_build__evaluation_links__evaluation_id=chain,
                ).exists()
                evaluating = Evaluation.objects.filter(
                    id=slow_eval, status__in=EVALUATION_EVALUATING, dispatches__finished_at__isnull=True
                ).exists()
                return cluster.status == ClusterStatus.RUNNING and chain_building and evaluating

            wait_until(busy_everywhere, timeout=40, what="a running cluster, a building chain, an evaluation")

            # --- the crash -------------------------------------------------------------------------------
            for worker in workers:
                worker.pause()
            first_boot = ServerBoot.objects.get(pid=first.process.pid)
            assert first.stop(signal.SIGKILL) == -signal.SIGKILL
            first = None
            crashed_at = timezone.now()
            open_rows = set(
                DispatchedJob.objects.filter(finished_at__isnull=True).values_list("id", flat=True)
            )
            open_attempt = ClusterAttempt.objects.get(cluster_job_id=cluster_id, finished_at__isnull=True)
            assert open_attempt.started_at is not None
            building = set(
                DerivationBuild.objects.filter(status=BuildStatus.BUILDING).values_list("id", flat=True)
            )
            single_building = building - {b for b in building if str(b) in pair_builds}
            assert single_building and len(open_rows) >= 4  # 2 members, a chain build, an evaluation
            first_boot.refresh_from_db()
            assert first_boot.stopped_at is None

            # --- the next boot -----------------------------------------------------------------------
            second = stack.enter_context(serve(service_env, tmp_path, port=port))
            first_boot.refresh_from_db()
            second_boot = ServerBoot.objects.exclude(id=first_boot.id).get()
            assert first_boot.stopped_at is not None and second_boot.recovered_at is not None
            # Its heartbeat was still fresh when the next boot recovered: only its process being gone
            # (same host, pid checked) made the killed boot dead.
            assert (second_boot.recovered_at - first_boot.last_heartbeat).total_seconds() < DEAD_BOOT_SECS
            assert not WorkerSession.objects.filter(
                server_boot=first_boot.id, closed_at__isnull=True
            ).exists()
            # No assignment and no attempt of the earlier boot is open.
            assert not DispatchedJob.objects.filter(id__in=open_rows, finished_at__isnull=True).exists()
            assert set(DispatchedJob.objects.filter(id__in=open_rows).values_list("outcome", flat=True)) == {
                DispatchOutcome.ABANDONED
            }
            assert not DispatchedJob.objects.filter(finished_at__isnull=True).exists()
            open_attempt.refresh_from_db()
            assert open_attempt.finished_at is not None and open_attempt.outcome == AttemptOutcome.ABORTED
            assert not ClusterAttempt.objects.filter(finished_at__isnull=True).exists()
            # A started attempt with budget left and no dead member: the cluster is queued again.
            cluster = ClusterJob.objects.get(id=cluster_id)
            assert (cluster.status, cluster.attempts) == (ClusterStatus.QUEUED, 1)
            # Building shared builds went back to Queued (every dependency of theirs is done), their running
            # attempts Aborted.
            assert set(DerivationBuild.objects.filter(id__in=building).values_list("status", flat=True)) == {
                BuildStatus.QUEUED
            }
            assert not BuildAttempt.objects.filter(outcome=BuildAttemptOutcome.RUNNING).exists()
            assert BuildAttempt.objects.filter(
                build_id__in=single_building, outcome=BuildAttemptOutcome.ABORTED
            ).exists()
            # The evaluation that was on a worker went back to Queued, with its phase event. The waiting
            # pass (on Celery, running all along) may have parked it since: no worker is connected yet.
            slow = Evaluation.objects.get(id=slow_eval)
            assert slow.status == EvaluationStatus.QUEUED or (
                slow.status == EvaluationStatus.WAITING and slow.waiting_reason["reason"] == "eval_workers"
            ), (slow.status, slow.waiting_reason)
            requeued = RecordEntry.objects.filter(
                record__job_key=f"eval:{slow_eval}", body__contains="server restarted while its evaluation"
            ).values_list("body", flat=True)
            assert len(requeued) == 1 and "Queued" in requeued[0]
            _records_agree_with_rows(
                [f"eval:{e}" for e in (pair, chain, slow_eval)] + [f"cluster:{cluster_id}"]
            )

            # --- the same workers reconnect and finish -------------------------------------------------
            for worker in workers:
                worker.resume()

            def finished() -> bool:
                statuses = {_status(e) for e in (pair, chain, slow_eval)}
                done = ClusterJob.objects.get(id=cluster_id).status == ClusterStatus.COMPLETED
                return done and statuses == {EvaluationStatus.COMPLETED}

            wait_until(
                finished, timeout=75, interval=0.5, what="every evaluation and the cluster to complete"
            )
        except BaseException:
            _dump(first or locals().get("second"), workers)
            print(f"--- celery\n{beat.log()[-6000:]}")
            raise

    # The same four worker processes reconnected to the new boot by themselves and did the rest.
    assert set(
        WorkerSession.objects.filter(server_boot=second_boot.id).values_list("worker__name", flat=True)
    ) == set(ids)
    later = DispatchedJob.objects.filter(dispatched_at__gt=crashed_at)
    assert later.filter(cluster_attempt__isnull=False).exists()
    assert set(later.values_list("worker__name", flat=True)) <= set(ids)
    assert (
        ClusterAttempt.objects.filter(cluster_job_id=cluster_id, outcome=AttemptOutcome.SUCCEEDED).count()
        == 1
    )
    assert ClusterJob.objects.get(id=cluster_id).attempts == 2
    _records_agree_with_rows([f"eval:{e}" for e in (pair, chain, slow_eval)] + [f"cluster:{cluster_id}"])
