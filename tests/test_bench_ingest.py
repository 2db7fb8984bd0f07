"""bench/ingest.py runs to its last line on a small graph, in both shapes, in a process of its own (the
bench directory on sys.path would shadow top-level names for the rest of the suite): its raw COPY limit
writes every column the ingest writes (a column added without a database default broke it once)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.processes import ROOT, database_env

pytestmark = pytest.mark.django_db(transaction=True)  # the subprocess needs the test database


def bench(*args: str) -> list[str]:
    env = database_env(redis=False)
    env["BENCH_DATABASE_URL"] = env["DATABASE_URL"]
    result = subprocess.run(
        [sys.executable, "bench/ingest.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_nixpkgs_shape_arrives_whole_and_prints_the_issue_line() -> None:
    lines = bench("--derivations", "300")
    assert any(line.strip().startswith("whole:") for line in lines), lines
    assert lines[-1].startswith("ingest: 300 derivations in "), lines
    assert "of the copy limit" in lines[-1] and "known " in lines[-1], lines


def test_the_independent_shape_queues_every_leaf() -> None:
    lines = bench("--derivations", "300", "--shape", "independent", "--part-size", "100")
    assert lines[-1].startswith("independent: 300 derivations in parts of 100 "), lines
    assert "; all queued " in lines[-1], lines


def test_the_independent_shape_over_a_websocket_on_a_fresh_database_queues_every_leaf() -> None:
    lines = bench("--derivations", "300", "--shape", "independent", "--part-size", "100", "--socket")
    assert lines[-1].startswith("independent over a WebSocket, fresh database: 300 derivations"), lines
    assert ", all queued " in lines[-1] and "evaluation Waiting" in lines[-1], lines
