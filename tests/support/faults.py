"""Shared by the fault tests (tests/test_faults_*.py, docs/faults.md): the service's environment, an
operator over REST, evaluations and clusters submitted the way a client would, and the invariants
checked by SQL afterwards on the tables operations.md names (dispatched_job, cluster_attempt,
cluster_member, cluster_job)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from tests.support.processes import (
    ServeProcess,
    WorkerProcess,
    free_port,
    http_json,
    reference_worker,
    wait_until,
)

# Reference-worker flags that keep a run short: frequent heartbeats and idle requests.
FAST_WORKER = ["--heartbeat-secs", "1", "--idle-request-secs", "0.5", "--cpu-core-score", "800"]


def service_env(redis_url: str | None = None, **overrides: str | None) -> dict[str, str]:
    """The environment of `serve` and Celery on the test database and Redis (skips without them)."""
    from tests.support.processes import database_env

    env = {
        "REDIS_URL": redis_url or settings.REDIS_URL,
        "GRADIENT_SCHEDULER_PASS_INTERVAL_SECS": "1",
        "GRADIENT_SCHEDULER_CLUSTER_PREPARE_TIMEOUT_SECS": "10",
        "GRADIENT_SCHEDULER_CLUSTER_RETRY_WAIT_SECS": "1",
        "GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS": "15",
        "GRADIENT_SCHEDULING_POLICY": "simple",
    }
    env.update({k: v for k, v in overrides.items() if v is not None})
    return database_env(**env)


@dataclass
class Operator:
    """A staff user's REST token against one server's base URL."""

    base: str
    token: str

    @classmethod
    def login(cls, server: ServeProcess) -> Operator:
        from django.contrib.auth.models import User

        if not User.objects.filter(username="operator").exists():
            User.objects.create_user("operator", password="operator-pw", is_staff=True)
        status, body = http_json(
            "POST",
            f"{server.base_url}/api/v1/auth/token",
            {"username": "operator", "password": "operator-pw"},
        )
        assert status == 200, body
        return cls(server.base_url, str(body["token"]))

    def post(self, path: str, body: dict[str, Any], expect: int = 201) -> dict[str, Any]:
        status, answer = http_json("POST", f"{self.base}{path}", body, self.token)
        assert status == expect, (path, status, answer)
        return answer  # type: ignore[no-any-return]

    def project(self, name: str = "demo") -> None:
        self.post("/api/v1/projects", {"name": name})

    def worker(self, name: str, project: str = "demo") -> tuple[str, str]:
        body = self.post("/api/v1/workers", {"name": name, "projects": [project]})
        return str(body["id"]), str(body["token"])

    def evaluation(self, url: str, project: str = "demo") -> str:
        return str(
            self.post("/api/v1/evaluations", {"project": project, "repository": url, "commit": "1"})["id"]
        )

    def cluster(self, members: list[dict[str, Any]], **options: Any) -> str:
        return str(self.post("/api/v1/clusters", {"members": members, **options})["id"])


def ready_builds(url: str) -> list[str]:
    """An evaluation of `url` evaluated by the test itself (as tests/test_clusters_e2e.py does): Building,
    its shared builds Queued and ready for a cluster before any worker could take one alone."""
    from gradient.scheduling.models import Project
    from tests.clusters_helpers import evaluated_builds

    return [str(b.id) for b in evaluated_builds(Project.objects.get(name="demo"), url)]


# --- Invariants, by SQL -----------------------------------------------------------------------------

# Each query returns the rows that break its rule; every one must come back empty.
INVARIANTS: dict[str, str] = {
    "a job open twice at once": """
        SELECT a.job_id, a.id, b.id FROM dispatched_job a
        JOIN dispatched_job b ON a.job_id = b.job_id AND a.id < b.id
        WHERE a.dispatched_at < COALESCE(b.finished_at, 'infinity')
          AND b.dispatched_at < COALESCE(a.finished_at, 'infinity')
    """,
    # A member that completed in an attempt that then failed runs again in the next attempt: all or
    # nothing. What counts is single assignments and Succeeded attempts.
    "a job completed by two assignments (single, or of Succeeded attempts)": """
        SELECT d.job_id, count(*) FROM dispatched_job d
        LEFT JOIN cluster_attempt a ON a.id = d.cluster_attempt_id
        WHERE d.outcome = 'Completed' AND (d.cluster_attempt_id IS NULL OR a.outcome = 'Succeeded')
        GROUP BY d.job_id HAVING count(*) > 1
    """,
    "an attempt that did not claim every member of its cluster, each once, on its own worker": """
        SELECT a.id, count(d.id), count(DISTINCT d.worker_id), count(DISTINCT d.job_id),
               (SELECT count(*) FROM cluster_member m WHERE m.cluster_job_id = a.cluster_job_id)
        FROM cluster_attempt a LEFT JOIN dispatched_job d ON d.cluster_attempt_id = a.id
        GROUP BY a.id
        HAVING count(d.id) <> (SELECT count(*) FROM cluster_member m
                               WHERE m.cluster_job_id = a.cluster_job_id)
            OR count(DISTINCT d.worker_id) <> count(d.id)
            OR count(DISTINCT d.job_id) <> count(d.id)
    """,
    "an attempt row for a job that is not a member of its cluster": """
        SELECT d.id, d.job_id FROM dispatched_job d JOIN cluster_attempt a ON a.id = d.cluster_attempt_id
        WHERE NOT EXISTS (
            SELECT 1 FROM cluster_member m WHERE m.cluster_job_id = a.cluster_job_id
              AND d.job_id = CASE WHEN m.evaluation_id IS NOT NULL THEN 'eval:' || m.evaluation_id::text
                                  ELSE 'build:' || m.derivation_build_id::text END)
    """,
    "the member rows of one attempt claimed at different moments (not one transaction)": """
        SELECT cluster_attempt_id FROM dispatched_job WHERE cluster_attempt_id IS NOT NULL
        GROUP BY cluster_attempt_id HAVING count(DISTINCT dispatched_at) > 1
    """,
    "a finished attempt with an open member row": """
        SELECT a.id, d.id FROM cluster_attempt a JOIN dispatched_job d ON d.cluster_attempt_id = a.id
        WHERE a.finished_at IS NOT NULL AND d.finished_at IS NULL
    """,
    "a cluster with two open attempts": """
        SELECT cluster_job_id FROM cluster_attempt WHERE finished_at IS NULL
        GROUP BY cluster_job_id HAVING count(*) > 1
    """,
    "a cluster member assigned as a single job": """
        SELECT d.id, d.job_id FROM dispatched_job d JOIN cluster_member m
          ON d.job_id = CASE WHEN m.evaluation_id IS NOT NULL THEN 'eval:' || m.evaluation_id::text
                             ELSE 'build:' || m.derivation_build_id::text END
        WHERE d.cluster_attempt_id IS NULL
    """,
    "a Completed cluster without exactly one Succeeded attempt": """
        SELECT c.id FROM cluster_job c WHERE c.status = 'Completed'
          AND (SELECT count(*) FROM cluster_attempt a
               WHERE a.cluster_job_id = c.id AND a.outcome = 'Succeeded') <> 1
    """,
    "a Succeeded attempt whose member rows did not all complete": """
        SELECT a.id, d.id, d.outcome FROM cluster_attempt a
        JOIN dispatched_job d ON d.cluster_attempt_id = a.id
        WHERE a.outcome = 'Succeeded' AND d.outcome IS DISTINCT FROM 'Completed'
    """,
}


def invariant_violations() -> dict[str, list[tuple[Any, ...]]]:
    """Every invariant's offending rows, by rule; {} when all hold."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    with connection.cursor() as cursor:
        for rule, sql in INVARIANTS.items():
            cursor.execute(sql)
            rows = [tuple(r) for r in cursor.fetchall()]
            if rows:
                found[rule] = rows
    return found


def scalar(sql: str, params: tuple[Any, ...] = ()) -> Any:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return row[0] if row else None


def jobs_not_completed_exactly_once(evaluation_ids: list[str]) -> dict[str, Any]:
    """For evaluations that all completed: each one's evaluation job has at most one Completed
    assignment, and one at all or an assignment that reported its eval_result (a server killed between
    eval_result and JobCompleted leaves that row Abandoned; the evaluation may then finish on those
    builds); each of their Completed builds exactly one assignment that reported its build_output (the
    report that completes a build) and at most one Completed one (the same kill leaves that row
    Abandoned, the build done). Returns the offenders with their counts."""
    problems: dict[str, Any] = {}
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT 'eval:' || e.id::text, count(d.id) FILTER (WHERE d.outcome = 'Completed'),
                   count(d.id) FILTER (WHERE d.phase = 'eval_result')
            FROM evaluation e LEFT JOIN dispatched_job d ON d.job_id = 'eval:' || e.id::text
            WHERE e.id::text = ANY(%s)
            GROUP BY e.id
            HAVING count(d.id) FILTER (WHERE d.outcome = 'Completed') > 1
                OR count(d.id) FILTER (WHERE d.outcome = 'Completed' OR d.phase = 'eval_result') = 0
            """,
            (evaluation_ids,),
        )
        for job_id, completed, results in cursor.fetchall():
            problems[job_id] = {"completed": completed, "eval_result": results}
        cursor.execute(
            """
            SELECT 'build:' || b.id::text,
                   count(d.id) FILTER (WHERE d.phase = 'build_output'),
                   count(d.id) FILTER (WHERE d.outcome = 'Completed')
            FROM derivation_build b LEFT JOIN dispatched_job d ON d.job_id = 'build:' || b.id::text
            WHERE b.status = 'Completed' AND b.id IN (
                SELECT build_id FROM evaluation_build WHERE evaluation_id::text = ANY(%s))
            GROUP BY b.id
            HAVING count(d.id) FILTER (WHERE d.phase = 'build_output') <> 1
                OR count(d.id) FILTER (WHERE d.outcome = 'Completed') > 1
            """,
            (evaluation_ids,),
        )
        for job_id, outputs, completed in cursor.fetchall():
            problems[job_id] = {"build_output": outputs, "completed": completed}
    return problems


def statuses(evaluation_ids: list[str]) -> dict[str, int]:
    from gradient.scheduling.models import Evaluation

    counts: dict[str, int] = {}
    for status in Evaluation.objects.filter(id__in=evaluation_ids).values_list("status", flat=True):
        counts[status] = counts.get(status, 0) + 1
    return counts


def wait_all_completed(evaluation_ids: list[str], cluster_ids: list[str], timeout: float, what: str) -> None:
    from gradient.clusters.models import ClusterJob

    def done() -> bool:
        evals = statuses(evaluation_ids) == {"Completed": len(evaluation_ids)}
        clusters = set(ClusterJob.objects.filter(id__in=cluster_ids).values_list("status", flat=True))
        return evals and clusters <= {"Completed"}

    wait_until(done, timeout=timeout, interval=0.5, what=f"{what}: {statuses(evaluation_ids)}")


# --- A Redis server of the test's own ----------------------------------------------------------------


@dataclass
class RedisServer:
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_until(self.answers, timeout=10, interval=0.05, what=f"redis-server on {self.port}")

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None


@contextlib.contextmanager
def own_redis(log_dir: Path) -> Iterator[RedisServer]:
    """A redis-server of this test on a free port (never the shared one), without persistence: a restart
    loses every key, as a crashed Redis would."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    server = RedisServer(port=free_port(), log_path=log_dir / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# --- What a frame may not change ------------------------------------------------------------------

# Written by every message a session sends (the throttled "seen" mark), not by what the message says.
SEEN_COLUMNS = frozenset({("worker", "last_seen"), ("worker_session", "last_seen")})


def _tables(cursor: Any) -> list[str]:
    cursor.execute(
        "SELECT table_name FROM information_schema.tables "
        "WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY table_name"
    )
    return [r[0] for r in cursor.fetchall()]


def database_snapshot(skip: frozenset[tuple[str, str]] = SEEN_COLUMNS) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the test database, without the `skip` columns; for small databases."""
    result: dict[str, list[tuple[Any, ...]]] = {}
    with connection.cursor() as cursor:
        for table in _tables(cursor):
            cursor.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = 'public' "
                "AND table_name = %s ORDER BY ordinal_position",
                (table,),
            )
            columns = [c for (c,) in cursor.fetchall() if (table, c) not in skip]
            listed = ", ".join(f'"{c}"' for c in columns)
            cursor.execute(f'SELECT {listed} FROM "{table}" ORDER BY 1')  # noqa: S608 (catalogue names)
            result[table] = sorted((tuple(row) for row in cursor.fetchall()), key=repr)
    return result


def explain_jobs(job_keys: list[str]) -> str:
    """Each job's assignment rows and (for an evaluation) its record's entries, for a failure message."""
    from gradient.records.models import RecordEntry
    from gradient.scheduling.models import DispatchedJob

    lines: list[str] = []
    for key in job_keys:
        lines.append(f"== {key}")
        for r in DispatchedJob.objects.filter(job_id=key).order_by("dispatched_at"):
            lines.append(
                f"  row {r.id} worker {r.worker_id} {r.dispatched_at:%H:%M:%S.%f} -> "
                f"{r.finished_at and f'{r.finished_at:%H:%M:%S.%f}'} {r.outcome} {r.phase!r} {r.reason!r}"
            )
        if key.startswith("eval:"):
            for body in (
                RecordEntry.objects.filter(record__job_key=key)
                .order_by("revision")
                .values_list("body", flat=True)
            ):
                lines.append(f"  record {body[:300]}")
    return "\n".join(lines)


def start_workers(
    stack: ExitStack,
    op: Operator,
    ws_url: str,
    log_dir: Path,
    names: Iterable[str],
    extra_args: Iterable[str] = (),
) -> list[WorkerProcess]:
    """Register a worker per name (through `op`) and start each as a fast reference worker on `ws_url`
    (x86_64-linux, two slots, then `extra_args`), stopped when `stack` closes."""
    workers = []
    for name in names:
        worker_id, token = op.worker(name)
        workers.append(
            stack.enter_context(
                reference_worker(
                    ws_url,
                    worker_id,
                    token,
                    log_dir,
                    name=name,
                    extra_args=[*FAST_WORKER, "--arch", "x86_64-linux", "--slots", "2", *extra_args],
                )
            )
        )
    return workers
