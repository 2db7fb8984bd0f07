"""End to end (issue 6): one real `serve` process and three real reference workers (sim executor) in
zones a, a and b run cluster jobs over the real protocol.

- A `same_zone` cluster of two ready builds, one pinned to the zone-a worker `wa1`, is seated in zone a
  and completes: cluster Completed, its attempt Succeeded, both builds Completed, and the members greeted
  each other with ClusterSignals inside that attempt before they built.
- A cluster with retry budget 2 loses one member's worker to SIGKILL while its attempt runs: the attempt
  closes Failed with the Retry verdict, the dead worker's session is closed, and the cluster completes on
  a second attempt seated on the two surviving workers, whose members signalled each other.

How it is made deterministic, and why these choices:

- The members' jobs are made ready without racing single assignment: an evaluation is submitted through
  the service, moved to Building and its eval_result (the sim graph's own derivations, so the store names
  carry the `__ms<N>` build durations any sim worker honours) ingested with
  `graph.ingest_eval_result`; both clusters are created over REST before any worker connects. Single
  assignment never sees a member, so nothing else can take the builds.
- `serve` runs without REDIS_URL, so its periodic passes (cluster-dispatch every second here, worker
  liveness) run in-process and its pushes use the in-memory channel layer; the workers and the REST
  calls only ever talk to that one process, as in a single-node deployment. The test process only reads
  the database. A worker killed with SIGKILL has its socket closed by the kernel, so `serve` closes its
  session at once (the disconnect path); the short GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS is the
  liveness backstop for a socket that would stay open.
- Order: the zone-a workers start first, so the older, pinned, same_zone cluster is placed before the
  second cluster (which needs two workers) can be; the zone-b worker starts once the first cluster holds
  its seats. The second cluster is not same_zone, so after any one of its seated workers dies the two
  survivors (one per zone at worst) seat it again. Its builds take 6 s, and the kill comes only after
  both members logged their peer's ClusterSignal, so the attempt is Running, past its handshake.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User

from gradient.clusters.models import (
    AttemptOutcome,
    ClusterAttempt,
    ClusterJob,
    ClusterSeat,
    ClusterStatus,
    SeatResult,
)
from gradient.scheduling.models import BuildStatus, DerivationBuild, Evaluation, EvaluationStatus, Project
from gradient.workers.models import Worker, WorkerSession
from tests.clusters_helpers import evaluated_builds, record_problems
from tests.support.processes import (
    ServeProcess,
    WorkerProcess,
    base_env,
    http_json,
    reference_worker,
    serve,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FAST = [
    "--heartbeat-secs",
    "0.5",
    "--idle-request-secs",
    "0.5",
    "--cpu-core-score",
    "800",
    "--arch",
    "x86_64-linux",
    "--slots",
    "1",
]
PINNED_URL = "sim:wide?n=2&duration_ms=1500&salt=pinned"
RETRIED_URL = "sim:wide?n=2&duration_ms=6000&salt=retried"


@pytest.fixture
def serve_env() -> dict[str, str]:
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("needs PostgreSQL shared by the test and serve")
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return base_env(
        DATABASE_URL=url,
        REDIS_URL=None,  # in-process passes and the in-memory channel layer, inside serve
        GRADIENT_SCHEDULER_PASS_INTERVAL_SECS="1",
        GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS="10",
    )


def _post(server: ServeProcess, path: str, body: dict[str, Any], token: str) -> dict[str, Any]:
    status, answer = http_json("POST", f"{server.base_url}{path}", body, token)
    assert status == 201, answer
    return answer  # type: ignore[no-any-return]


def _attempts(cluster_id: str) -> list[ClusterAttempt]:
    return list(ClusterAttempt.objects.filter(cluster_job_id=cluster_id).order_by("number"))


def _seats(attempt: ClusterAttempt) -> list[ClusterSeat]:
    return list(
        ClusterSeat.objects.filter(attempt=attempt).select_related("worker").order_by("role", "index")
    )


def _heard(worker: WorkerProcess, attempt: ClusterAttempt) -> set[str]:
    """The peers (role[index]) whose ClusterSignal this worker logged in this attempt."""
    pattern = rf"cluster signal in attempt {attempt.id} from (\w+\[\d+\])"
    return set(re.findall(pattern, worker.log()))


def _logs(server: ServeProcess, workers: dict[str, WorkerProcess]) -> str:
    parts = [f"--- {name} ---\n{w.log()[-3000:]}" for name, w in workers.items()]
    return "\n".join([*parts, f"--- serve ---\n{server.log()[-6000:]}"])


def test_a_pinned_same_zone_cluster_completes_in_zone_a_and_a_killed_member_is_retried_without_its_worker(
    tmp_path: Path, serve_env: dict[str, str]
) -> None:
    User.objects.create_user("operator", password="operator-pw", is_staff=True)
    with ExitStack() as stack:
        server = stack.enter_context(serve(serve_env, tmp_path))
        _, body = http_json(
            "POST",
            f"{server.base_url}/api/v1/auth/token",
            {"username": "operator", "password": "operator-pw"},
        )
        token = str(body["token"])
        _post(server, "/api/v1/projects", {"name": "demo"}, token)
        registered = {
            name: _post(server, "/api/v1/workers", {"name": name, "projects": ["demo"]}, token)
            for name in ("wa1", "wa2", "wb")
        }
        zones = {"wa1": "a", "wa2": "a", "wb": "b"}
        project = Project.objects.get(name="demo")

        pinned_builds = evaluated_builds(project, PINNED_URL)
        retried_builds = evaluated_builds(project, RETRIED_URL)
        assert len(pinned_builds) == len(retried_builds) == 2
        pinned = _post(
            server,
            "/api/v1/clusters",
            {
                "members": [
                    {"build": str(pinned_builds[0].id), "role": "server", "pin": "wa1"},
                    {"build": str(pinned_builds[1].id), "role": "client"},
                ],
                "same_zone": True,
            },
            token,
        )
        retried = _post(
            server,
            "/api/v1/clusters",
            {
                "members": [
                    {"build": str(retried_builds[0].id), "role": "peer"},
                    {"build": str(retried_builds[1].id), "role": "peer"},
                ],
                "retry_budget": 2,
            },
            token,
        )
        assert pinned["status"] == retried["status"] == ClusterStatus.QUEUED

        workers: dict[str, WorkerProcess] = {}

        def start(name: str) -> None:
            workers[name] = stack.enter_context(
                reference_worker(
                    server.ws_url,
                    str(registered[name]["id"]),
                    str(registered[name]["token"]),
                    tmp_path,
                    name=name,
                    extra_args=[*FAST, "--zone", zones[name]],
                    env=base_env(),
                )
            )

        def waited(predicate: Any, what: str, timeout: float = 40.0) -> Any:
            return wait_until(predicate, timeout=timeout, what=f"{what}\n{_logs(server, workers)}")

        # 1. The pinned same_zone cluster is placed on the two zone-a workers and completes.
        start("wa1")
        start("wa2")
        waited(lambda: _attempts(pinned["id"]), "the pinned cluster to be placed")
        start("wb")
        waited(
            lambda: ClusterJob.objects.get(id=pinned["id"]).status == ClusterStatus.COMPLETED,
            "the pinned cluster to complete",
        )
        [attempt] = _attempts(pinned["id"])
        assert (attempt.outcome, attempt.verdict) == (AttemptOutcome.SUCCEEDED, "Complete")
        assert attempt.started_at is not None
        seats = _seats(attempt)
        assert [(s.role, s.worker.name, s.zone) for s in seats] == [
            ("client", "wa2", "a"),
            ("server", "wa1", "a"),
        ]
        assert all(s.result == SeatResult.SUCCEEDED for s in seats)
        assert {b.status for b in DerivationBuild.objects.filter(id__in=[b.id for b in pinned_builds])} == {
            BuildStatus.COMPLETED
        }
        assert Evaluation.objects.get(repository=PINNED_URL).status == EvaluationStatus.COMPLETED
        # The sim members greeted each other inside the attempt before they built.
        assert _heard(workers["wa1"], attempt) == {"client[0]"}
        assert _heard(workers["wa2"], attempt) == {"server[0]"}

        # 2. The second cluster starts on two of the three workers; SIGKILL one of them mid-attempt.
        first = waited(lambda: next(iter(_attempts(retried["id"])), None), "the second cluster to be placed")
        by_id = {str(w.id): w.name for w in Worker.objects.all()}
        names = [by_id[str(s.worker_id)] for s in _seats(first)]
        waited(
            lambda: all(_heard(workers[n], first) for n in names),
            "both members of the first attempt to hear each other",
        )
        first.refresh_from_db()
        assert first.started_at is not None and first.finished_at is None
        assert ClusterJob.objects.get(id=retried["id"]).status == ClusterStatus.RUNNING
        victim = names[0]
        workers[victim].process.kill()
        workers[victim].process.wait(10)

        waited(
            lambda: ClusterAttempt.objects.get(id=first.id).finished_at is not None,
            "the killed member's attempt to close",
        )
        first.refresh_from_db()
        assert (first.outcome, first.verdict) == (AttemptOutcome.FAILED, "Retry")
        assert ClusterSeat.objects.get(attempt=first, worker__name=victim).result == SeatResult.LOST
        assert not WorkerSession.objects.filter(worker__name=victim, closed_at__isnull=True).exists()

        # 3. The second attempt runs on the two survivors and completes.
        waited(
            lambda: ClusterJob.objects.get(id=retried["id"]).status == ClusterStatus.COMPLETED,
            "the second cluster to complete on its second attempt",
        )
        attempts = _attempts(retried["id"])
        assert [(a.number, a.outcome, a.verdict) for a in attempts] == [
            (1, AttemptOutcome.FAILED, "Retry"),
            (2, AttemptOutcome.SUCCEEDED, "Complete"),
        ]
        second = attempts[1]
        survivors = sorted({"wa1", "wa2", "wb"} - {victim})
        assert sorted(s.worker.name for s in _seats(second)) == survivors
        assert all(s.result == SeatResult.SUCCEEDED for s in _seats(second))
        for name in survivors:
            assert _heard(workers[name], second) == {"peer[0]", "peer[1]"} - {
                f"{s.role}[{s.index}]" for s in _seats(second) if s.worker.name == name
            }
        assert ClusterJob.objects.get(id=retried["id"]).attempts == 2
        assert {b.status for b in DerivationBuild.objects.filter(id__in=[b.id for b in retried_builds])} == {
            BuildStatus.COMPLETED
        }
        assert Evaluation.objects.get(repository=RETRIED_URL).status == EvaluationStatus.COMPLETED

        # Every record (both clusters, both evaluations) agrees with its rows.
        keys = [ClusterJob.objects.get(id=c["id"]).job_key for c in (pinned, retried)]
        keys += [e.job_key for e in Evaluation.objects.filter(repository__in=[PINNED_URL, RETRIED_URL])]
        assert record_problems(*keys) == {}

        # REST tells the same story.
        status, read = http_json("GET", f"{server.base_url}/api/v1/clusters/{retried['id']}", token=token)
        assert status == 200, read
        assert read["status"] == ClusterStatus.COMPLETED
        history_rows = [(a["number"], a["outcome"], a["verdict"]) for a in read["attempt_history"]]
        assert history_rows == [(1, "Failed", "Retry"), (2, "Succeeded", "Complete")]
        assert {s["worker_id"] for s in read["attempt_history"][1]["seats"]} == {
            str(registered[n]["id"]) for n in survivors
        }
