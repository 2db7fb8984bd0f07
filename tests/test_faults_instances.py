"""Several instances (issue 9): two `serve` processes and a Celery worker with beat share one PostgreSQL and
one Redis; reference workers are spread over both servers. A run of many evaluations (some of them
cluster members, plus a cluster of two ready shared builds) assigns every single job exactly once and
every cluster attempt all or nothing, which SQL on dispatched_job, cluster_attempt, cluster_member and
cluster_job shows afterwards.

Members are made so that single assignment can never see them first: the evaluation clusters are created
right after their evaluations, before any worker connects; the build cluster's builds are ingested by the
test (as tests/test_clusters_e2e.py does) and clustered before any worker connects. Evaluations are
submitted through both servers. The short form runs 12 evaluations and 3 clusters; the long form
(--faults-long, GRADIENT_FAULTS_LONG=1) 80 evaluations and 10 clusters.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from gradient.clusters.models import ClusterJob
from gradient.recovery.models import ServerBoot
from gradient.scheduling.models import DispatchedJob
from gradient.workers.models import WorkerSession
from tests.support.faults import (
    Operator,
    invariant_violations,
    jobs_not_completed_exactly_once,
    ready_builds,
    scalar,
    service_env,
    start_workers,
    wait_all_completed,
)
from tests.support.processes import ServeProcess, WorkerProcess, celery_worker, serve

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.django_db(transaction=True)]

SHAPES = (
    "sim:wide?n=3&duration_ms=50&salt={i}",
    "sim:chain?n=3&duration_ms=50&salt={i}",
    "sim:diamond?duration_ms=50&salt={i}",
    # No salt: every evaluation of this shape shares the same shared builds.
    "sim:chain?n=2&duration_ms=50",
)


def _dump(servers: list[ServeProcess], workers: list[WorkerProcess], celery_log: str) -> None:
    for w in workers:
        print(f"--- {w.name}\n{w.log()[-2000:]}")
    for s in servers:
        print(f"--- serve {s.port}\n{s.log()[-4000:]}")
    print(f"--- celery\n{celery_log[-4000:]}")
    for c in ClusterJob.objects.all():
        print("cluster", c.id, c.status, c.attempts, c.waiting_reason)


def test_two_servers_and_celery_assign_every_job_once_and_every_cluster_attempt_all_or_nothing(
    tmp_path: Path, faults_long: bool
) -> None:
    env = service_env()
    evaluations_n, eval_clusters_n, build_clusters_n, workers_per_server = (
        (80, 8, 2, 3) if faults_long else (12, 2, 1, 2)
    )
    workers: list[WorkerProcess] = []
    servers: list[ServeProcess] = []
    with ExitStack() as stack:
        beat = stack.enter_context(celery_worker(env, tmp_path))
        servers = [stack.enter_context(serve(env, tmp_path)) for _ in range(2)]
        ops = [Operator.login(s) for s in servers]
        ops[0].project("demo")
        try:
            # Work first, members clustered at once: no worker is connected yet to take a member alone.
            evaluations: list[str] = []
            for i in range(evaluations_n):
                evaluations.append(ops[i % 2].evaluation(SHAPES[i % len(SHAPES)].format(i=i)))
            clusters: list[str] = []
            for c in range(eval_clusters_n):
                pair = [
                    ops[c % 2].evaluation(f"sim:wide?n=2&duration_ms=50&salt=member-{c}-{k}")
                    for k in range(2)
                ]
                evaluations += pair
                clusters.append(ops[c % 2].cluster([{"evaluation": e, "role": "peer"} for e in pair]))
            for c in range(build_clusters_n):
                builds = ready_builds(f"sim:wide?n=2&duration_ms=300&salt=built-{c}")
                clusters.append(
                    ops[1 - c % 2].cluster(
                        [{"build": builds[0], "role": "server"}, {"build": builds[1], "role": "client"}],
                        retry_budget=2,
                    )
                )
            member_evaluations = set(evaluations[evaluations_n:])

            # Workers spread over both servers.
            for s, server in enumerate(servers):
                names = [f"w{s}{k}" for k in range(workers_per_server)]
                workers += start_workers(stack, ops[0], server.ws_url, tmp_path, names)

            timeout = 300 if faults_long else 90
            wait_all_completed(evaluations, clusters, timeout, "every evaluation and cluster to complete")
        except BaseException:
            _dump(servers, workers, beat.log())
            raise

    # Both servers held sessions and handed out work.
    boots = list(ServerBoot.objects.values_list("id", flat=True))
    assert len(boots) == 2
    for boot in boots:
        assert WorkerSession.objects.filter(server_boot=boot).exists()
        assert DispatchedJob.objects.filter(
            worker__sessions__server_boot=boot, cluster_attempt__isnull=True
        ).exists()
    # Every cluster completed, each through attempts that claimed all of its members or none.
    assert set(ClusterJob.objects.filter(id__in=clusters).values_list("status", flat=True)) == {"Completed"}
    assert invariant_violations() == {}
    # Every job finished exactly once, and this fault-free run gave each single job one assignment, ever,
    # besides ones its worker declined (the reference worker declines an AssignJob that finds no free
    # slot: two idle RequestJobs crossed one answer), which the protocol returns to the pool.
    assert jobs_not_completed_exactly_once(evaluations) == {}
    assert (
        scalar(
            "SELECT count(*) FROM (SELECT job_id FROM dispatched_job WHERE cluster_attempt_id IS NULL "
            "AND reason NOT LIKE 'declined:%%' GROUP BY job_id HAVING count(*) > 1) twice"
        )
        == 0
    )
    # The member evaluations ran as members only, one attempt row each per attempt.
    member_keys = [f"eval:{e}" for e in member_evaluations]
    assert not DispatchedJob.objects.filter(job_id__in=member_keys, cluster_attempt__isnull=True).exists()
    assert set(
        DispatchedJob.objects.filter(job_id__in=member_keys, outcome="Completed").values_list(
            "job_id", flat=True
        )
    ) == set(member_keys)
