"""A PostgreSQL outage (issue 17, finding 2): the test's own PostgreSQL is stopped under a busy `serve`
and started again. During the outage every consumer closes its socket with 1011 and its session close
fails; the process knows which of its sessions are dead and closes them as soon as the database answers
(consumer._reap_unclosed), so every worker is back within seconds, not when the liveness pass (120 s)
frees its session. Nothing is lost: every evaluation, submitted before or after, completes.

It never touches the shared PostgreSQL: initdb, pg_ctl and createdb make one of its own
(tests/support/postgres.py), and `serve` runs without Redis (in-process channel layer and passes).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.faults import FAST_WORKER
from tests.support.postgres import PostgresServer, operator_service_on_own_postgres
from tests.support.processes import base_env, http_json, reference_worker, wait_until

pytestmark = pytest.mark.faults

WORKERS = 3
OUTAGE_SECS = 8.0
BACK_WITHIN_SECS = 10.0


def _query(pg: PostgresServer, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    try:
        with psycopg.connect(
            host="127.0.0.1", port=pg.port, user="postgres", dbname="gradient", connect_timeout=2
        ) as conn:
            return list(conn.execute(sql, params).fetchall())
    except psycopg.OperationalError:
        return []


def _statuses(pg: PostgresServer, ids: list[str]) -> dict[str, str]:
    return dict(_query(pg, "SELECT id::text, status FROM evaluation WHERE id::text = ANY(%s)", (ids,)))


@contextlib.contextmanager
def _workers(server_url: str, ids_tokens: list[tuple[str, str]], log_dir: Path) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for n, (worker_id, token) in enumerate(ids_tokens):
            stack.enter_context(
                reference_worker(
                    server_url,
                    worker_id,
                    token,
                    log_dir,
                    name=f"worker-{n}",
                    extra_args=[*FAST_WORKER, "--slots", "2"],
                    env=base_env(),
                )
            )
        yield


def test_after_a_postgresql_outage_every_worker_is_back_within_seconds_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    with operator_service_on_own_postgres(tmp_path, GRADIENT_SCHEDULER_PASS_INTERVAL_SECS="1") as service:
        pg, server, token = service.pg, service.server, service.token

        def post(path: str, data: dict[str, Any]) -> dict[str, Any]:
            status, answer = http_json("POST", f"{server.base_url}{path}", data, token)
            assert status == 201, (path, status, answer)
            return answer  # type: ignore[no-any-return]

        post("/api/v1/projects", {"name": "demo"})
        workers = [post("/api/v1/workers", {"name": f"w{n}", "projects": ["demo"]}) for n in range(WORKERS)]
        ids_tokens = [(str(w["id"]), str(w["token"])) for w in workers]

        def evaluation(n: int) -> str:
            url = f"sim:chain?n=3&duration_ms=400&salt=outage{n}"
            return str(
                post("/api/v1/evaluations", {"project": "demo", "repository": url, "commit": "1"})["id"]
            )

        def open_sessions(after: datetime | None = None) -> set[str]:
            sql = "SELECT worker_id::text FROM worker_session WHERE closed_at IS NULL"
            params: tuple[Any, ...] = ()
            if after is not None:
                sql += " AND opened_at > %s"
                params = (after,)
            return {row[0] for row in _query(pg, sql, params)}

        with _workers(server.ws_url, ids_tokens, tmp_path):
            wanted = {w for w, _ in ids_tokens}
            wait_until(lambda: open_sessions() == wanted, timeout=30, what="every worker connected")
            before = [evaluation(n) for n in range(6)]
            wait_until(
                lambda: _query(pg, "SELECT 1 FROM dispatched_job WHERE finished_at IS NULL LIMIT 1"),
                timeout=30,
                what="a job out on a worker",
            )

            pg.stop("fast")
            time.sleep(OUTAGE_SECS)
            pg.start()
            back_at = datetime.now(UTC)
            started = time.monotonic()

            wait_until(
                lambda: open_sessions(after=back_at) == wanted,
                timeout=BACK_WITHIN_SECS,
                interval=0.25,
                what=f"every worker reconnected within {BACK_WITHIN_SECS:g} s of the database's return",
            )
            reconnected_in = time.monotonic() - started
            assert open_sessions() == wanted  # one open session each: the dead ones are closed

            after = [evaluation(n) for n in range(6, 9)]
            ids = before + after
            wait_until(
                lambda: set(_statuses(pg, ids).values()) == {"Completed"},
                timeout=120,
                interval=0.5,
                what=f"every evaluation completed: {_statuses(pg, ids)}",
            )
        print(f"every worker reconnected {reconnected_in:.1f} s after PostgreSQL came back")
