"""End to end: the real `serve` process and real reference-worker processes on loopback.

Workers registered over REST connect, send capabilities and heartbeats (visible over REST and in the
database), score the offered candidates and leave idle slots; one deactivated over REST is
disconnected and refused; one that stops heartbeating (SIGSTOP) is dropped by the liveness pass and
comes back when it resumes; SIGTERM on `serve` sends Draining and closes every session.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone

from gradient.recovery.models import ServerBoot
from gradient.scheduling.models import CandidateScore, Evaluation, JobKind, Project, eval_key
from gradient.workers.client.worker import EXIT_OK, EXIT_REJECTED
from gradient.workers.models import IdleSlot, WorkerSession
from gradient.workers.services import workers_drop_silent
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
    "1",
    "--cpu-core-score",
    "500",
    "--log-level",
    "debug",
]


def _database_url() -> str:
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("needs DATABASE_URL naming PostgreSQL")
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def _operator_token(server: ServeProcess) -> str:
    User.objects.create_user("operator", password="operator-pw", is_staff=True)
    status, body = http_json(
        "POST", f"{server.base_url}/api/v1/auth/token", {"username": "operator", "password": "operator-pw"}
    )
    assert status == 200, body
    return str(body["token"])


def _register(server: ServeProcess, token: str, name: str, projects: list[str]) -> tuple[str, str]:
    status, body = http_json(
        "POST", f"{server.base_url}/api/v1/workers", {"name": name, "projects": projects}, token
    )
    assert status == 201, body
    return str(body["id"]), str(body["token"])


def _workers(server: ServeProcess, token: str) -> dict[str, dict[str, Any]]:
    status, body = http_json("GET", f"{server.base_url}/api/v1/workers", token=token)
    assert status == 200, body
    return {row["name"]: row for row in body}


def _logs(*processes: ServeProcess | WorkerProcess) -> str:
    return "\n".join(f"--- {getattr(p, 'name', 'serve')} ---\n{p.log()[-4000:]}" for p in processes)


@pytest.fixture
def redis_env() -> Iterator[dict[str, str]]:
    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL (the channel layer shared by the processes)")
    yield base_env(DATABASE_URL=_database_url(), REDIS_URL=settings.REDIS_URL)


def test_workers_connect_heartbeat_get_deactivated_dropped_and_drained(
    tmp_path: Path, redis_env: dict[str, str]
) -> None:
    with ExitStack() as stack:
        server = stack.enter_context(serve(redis_env, tmp_path, extra_args=["--no-passes"]))
        operator = _operator_token(server)
        status, _ = http_json("POST", f"{server.base_url}/api/v1/projects", {"name": "demo"}, operator)
        assert status == 201
        evaluation = Evaluation.objects.create(
            project=Project.objects.get(name="demo"), repository="sim:chain?n=3", commit="0" * 40
        )
        registered = {
            name: _register(server, operator, name, ["demo"]) for name in ("alpha", "beta", "gamma")
        }
        # Another transaction holds the evaluation's row until all three have scored it: a claim skips a
        # locked job (SKIP LOCKED), so the first worker to connect cannot take it (and end it, which
        # forgets its scores) before a worker started later on a busy machine has been offered it.
        holder = stack.enter_context(psycopg.connect(_database_url()))
        holder.execute(
            f"SELECT id FROM {Evaluation._meta.db_table} WHERE id = %s FOR UPDATE", [evaluation.id]
        )
        workers = {
            name: stack.enter_context(
                reference_worker(
                    server.ws_url,
                    worker_id,
                    token,
                    tmp_path,
                    name=name,
                    extra_args=[
                        *FAST,
                        "--arch",
                        "x86_64-linux,aarch64-linux",
                        "--features",
                        "kvm",
                        "--zone",
                        "z1",
                    ],
                    env=base_env(),
                )
            )
            for name, (worker_id, token) in registered.items()
        }

        # They connect and send their capabilities, and their heartbeats keep coming.
        def all_connected() -> dict[str, dict[str, Any]] | None:
            rows = _workers(server, operator)
            ready = all(
                rows[n]["connected"] and rows[n]["architectures"] and rows[n]["metrics"]["reported_at"]
                for n in registered
            )
            return rows if ready else None

        rows = wait_until(
            all_connected, timeout=60, what="three connected workers\n" + _logs(server, *workers.values())
        )
        for name in registered:
            assert rows[name]["architectures"] == ["x86_64-linux", "aarch64-linux"]
            assert rows[name]["system_features"] == ["kvm"] and rows[name]["zone"] == "z1"
            assert rows[name]["capabilities"] == {"fetch": True, "eval": True, "build": True}
            assert rows[name]["metrics"]["ram_free_mb"] > 0 and rows[name]["cpu_core_score"] == 500
        first_beat = {n: datetime.fromisoformat(rows[n]["metrics"]["reported_at"]) for n in registered}
        wait_until(
            lambda: all(
                datetime.fromisoformat(_workers(server, operator)[n]["metrics"]["reported_at"])
                > first_beat[n]
                for n in registered
            ),
            timeout=30,
            what="a second heartbeat from every worker",
        )

        # They scored the offered evaluation and hold idle slots.
        alpha_id, beta_id, gamma_id = (registered[n][0] for n in ("alpha", "beta", "gamma"))
        wait_until(
            lambda: CandidateScore.objects.filter(job_id=eval_key(evaluation.id)).count() == 3,
            what="three scores for the offered evaluation\n" + _logs(server, *workers.values()),
        )
        holder.rollback()
        wait_until(
            lambda: (
                set(IdleSlot.objects.filter(worker_id=gamma_id).values_list("kind", flat=True))
                == {JobKind.EVAL, JobKind.BUILD}
            ),
            what="gamma's idle slots",
        )

        # alpha, deactivated over REST, is disconnected and refused from then on.
        status, body = http_json(
            "POST", f"{server.base_url}/api/v1/workers/{alpha_id}/deactivate", token=operator
        )
        assert status == 200 and body["active"] is False
        assert wait_until(
            lambda: workers["alpha"].process.poll() is not None, timeout=60, what="alpha to exit"
        ), workers["alpha"].log()
        assert workers["alpha"].process.returncode == EXIT_REJECTED
        assert "refused this worker (403)" in workers["alpha"].log()
        assert not _workers(server, operator)["alpha"]["connected"]
        assert WorkerSession.objects.get(worker_id=alpha_id).close_reason == "worker deactivated"

        # beta stops heartbeating; the liveness pass (run here, in another process than the socket's
        # server: the close order travels through Redis) drops it; resumed, it connects again.
        workers["beta"].pause()
        now_at: list[datetime] = []

        def beta_alone_silent() -> bool:
            # beta silent for 2.5 s while gamma was seen within the last second (on a busy machine a
            # heartbeat of gamma's can be late too: the drop below is then asked at a moment when only
            # beta is silent).
            now = timezone.now()
            open_sessions = WorkerSession.objects.filter(closed_at__isnull=True)
            if open_sessions.filter(
                worker_id=beta_id, last_seen__lt=now - timedelta(seconds=2.5)
            ).exists() and not (
                open_sessions.exclude(worker_id=beta_id)
                .filter(last_seen__lt=now - timedelta(seconds=1))
                .exists()
            ):
                now_at[:] = [now]
                return True
            return False

        wait_until(beta_alone_silent, timeout=30, what="beta to fall silent")
        assert workers_drop_silent(now=now_at[0], timeout_secs=2) == 1
        dropped = WorkerSession.objects.get(worker_id=beta_id)
        assert dropped.closed_at is not None and "silent" in dropped.close_reason
        assert not _workers(server, operator)["beta"]["connected"]
        workers["beta"].resume()
        wait_until(
            lambda: WorkerSession.objects.filter(worker_id=beta_id, closed_at__isnull=True).exists(),
            timeout=60,
            what="beta to reconnect\n" + _logs(server, workers["beta"]),
        )
        assert WorkerSession.objects.filter(worker_id=beta_id).count() == 2

        # SIGTERM on serve: Draining to every session, all closed, serve exits.
        assert server.stop(signal.SIGTERM, timeout=30) == 0, server.log()
        assert ServerBoot.objects.get().stopped_at is not None
        open_sessions = WorkerSession.objects.filter(closed_at__isnull=True)
        assert not open_sessions.exists(), list(open_sessions.values())
        drained = WorkerSession.objects.filter(close_reason="server draining").values_list(
            "worker_id", flat=True
        )
        assert {str(w) for w in drained} == {beta_id, gamma_id}
        for name in ("beta", "gamma"):
            assert "the server is draining" in workers[name].log(), workers[name].log()
            assert workers[name].stop() == EXIT_OK


def test_the_liveness_pass_of_serve_drops_a_worker_that_stops_heartbeating(tmp_path: Path) -> None:
    # No REDIS_URL: the in-memory channel layer and the in-process passes, as in embedded mode.
    env = base_env(
        DATABASE_URL=_database_url(), REDIS_URL=None, GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS="2"
    )
    with ExitStack() as stack:
        server = stack.enter_context(serve(env, tmp_path))
        operator = _operator_token(server)
        worker_id, token = _register(server, operator, "sleepy", [])
        worker = stack.enter_context(
            reference_worker(server.ws_url, worker_id, token, tmp_path, name="sleepy", extra_args=FAST)
        )
        wait_until(
            lambda: _workers(server, operator)["sleepy"]["connected"],
            timeout=60,
            what="sleepy to connect\n" + _logs(server, worker),
        )

        worker.pause()
        session = wait_until(
            lambda: WorkerSession.objects.filter(worker_id=worker_id, closed_at__isnull=False).first(),
            timeout=60,
            what="the liveness pass to drop sleepy\n" + _logs(server),
        )

        assert "silent for more than 2 s" in session.close_reason
        worker.resume()
        wait_until(
            lambda: WorkerSession.objects.filter(worker_id=worker_id, closed_at__isnull=True).exists(),
            timeout=60,
            what="sleepy to reconnect\n" + _logs(server, worker),
        )
