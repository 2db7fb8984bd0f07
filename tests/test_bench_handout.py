"""bench/handout.py's own instruments, each in a process of its own (the bench directory on sys.path
would shadow top-level names for the rest of the suite): the statement count of bench/counted_settings.py
and the naive SKIP LOCKED queue it measures the hand-out against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import ROOT, database_env

pytestmark = pytest.mark.django_db(transaction=True)  # the subprocesses need the test database

COUNTED = """
import asyncio, json, os, sys
import django
django.setup()
import psycopg
from django.db import connection
sys.path.insert(0, "bench")
from common import read_statement_counts
from pathlib import Path
counts = Path(os.environ["BENCH_STATEMENT_COUNTS"])
connection.ensure_connection()
before = read_statement_counts(counts)
with connection.cursor() as cursor:
    cursor.execute("SELECT 1")
    cursor.execute("SELECT %s", [2])
    cursor.executemany("SELECT %s", ((i,) for i in range(3)))
after_django = read_statement_counts(counts)

async def raw():
    async with await psycopg.AsyncConnection.connect(os.environ["DATABASE_URL"]) as conn:
        await conn.execute("SELECT 1")
        async with conn.cursor() as cursor:
            await cursor.executemany("SELECT %s", [(1,), (2,)])
        await conn.commit()

asyncio.run(raw())
print(json.dumps([before, after_django, read_statement_counts(counts)]))
"""


def python(script: str, env: dict[str, str]) -> Any:
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_counted_settings_count_every_statement_sent_and_no_commit(tmp_path: Path) -> None:
    env = database_env(redis=False, DJANGO_SETTINGS_MODULE="bench.counted_settings")
    env["BENCH_STATEMENT_COUNTS"] = str(tmp_path)
    before, after_django, after_raw = python(COUNTED, env)
    assert after_django - before == 1 + 1 + 3  # executemany: one per parameter set
    assert after_raw - after_django == 1 + 2  # the async cursors too; the commit is not a statement
    assert len(list(tmp_path.iterdir())) == 1  # one file per process


def test_counted_settings_count_nothing_without_a_directory() -> None:
    env = database_env(redis=False, DJANGO_SETTINGS_MODULE="bench.counted_settings")
    env.pop("BENCH_STATEMENT_COUNTS", None)
    script = (
        "import django, json, psycopg; django.setup(); print(json.dumps(psycopg.Cursor.execute.__qualname__))"
    )
    assert python(script, env) == "Cursor.execute"


NAIVE = """
import asyncio, json, os, sys
sys.path.insert(0, "bench")
from handout import NAIVE_TABLE, NaiveQueueDry, naive_queue
import psycopg
url = os.environ["DATABASE_URL"]
try:
    result = asyncio.run(naive_queue(url, int(sys.argv[1]), 8, float(sys.argv[2])))
    out = {"jobs": result.jobs, "left": result.left, "doubles": result.double_claims}
except NaiveQueueDry as exc:
    out = {"dry": str(exc)}
with psycopg.connect(url, autocommit=True) as conn:
    out["rows"] = conn.execute(f"SELECT count(*) FROM {NAIVE_TABLE}").fetchone()[0]
    conn.execute(f"DROP TABLE {NAIVE_TABLE}")
print(json.dumps(out))
"""


def naive(jobs: int, window: float) -> Any:
    env = database_env(redis=False)
    result = subprocess.run(
        [sys.executable, "-c", NAIVE, str(jobs), str(window)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_naive_queue_that_runs_dry_in_its_window_fails_loudly() -> None:
    out = naive(jobs=20, window=60)
    assert "ran dry" in out["dry"]
    assert "--naive-jobs" in out["dry"]


def test_naive_queue_completes_each_job_once_and_leaves_its_table_empty() -> None:
    out = naive(jobs=50_000, window=1)
    assert out.get("dry") is None
    assert out["jobs"] > 0
    assert out["left"] > 0
    assert out["doubles"] == 0
    assert out["rows"] == 0  # truncated: its dead rows would keep autovacuum busy in the hand-out window
