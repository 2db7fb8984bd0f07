"""After `migrate`, PostgreSQL's own catalogue shows the constraint and index names of the design with
the right predicates and delete actions (what outside tools read)."""

from __future__ import annotations

import pytest
from django.db import connection

pytestmark = pytest.mark.usefixtures("postgres_only")


def _indexdef(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename, indexdef FROM pg_indexes WHERE indexname = %s", [name])
        row = cursor.fetchone()
    assert row is not None, f"index {name} is missing"
    return f"{row[0]}: {row[1]}"


@pytest.mark.parametrize(
    ("name", "table", "column", "predicate"),
    [
        ("idx-cluster_member-evaluation", "cluster_member", "evaluation_id", "evaluation_id IS NOT NULL"),
        (
            "idx-cluster_member-derivation_build",
            "cluster_member",
            "derivation_build_id",
            "derivation_build_id IS NOT NULL",
        ),
        ("idx-cluster_attempt-open", "cluster_attempt", "cluster_job_id", "finished_at IS NULL"),
        ("idx-dispatched_job-open-job", "dispatched_job", "job_id", "finished_at IS NULL"),
    ],
)
def test_the_unique_partial_indexes_exist_with_their_predicates(
    name: str, table: str, column: str, predicate: str
) -> None:
    definition = _indexdef(name)
    assert definition.startswith(f"{table}: CREATE UNIQUE INDEX")
    assert f"({column})" in definition
    assert f"WHERE ({predicate})" in definition


def test_the_member_check_names_exactly_one_job() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conname = 'cluster_member-exactly-one-job' AND contype = 'c'"
        )
        row = cursor.fetchone()
    assert row is not None
    definition = row[0]
    assert "evaluation_id IS NOT NULL" in definition and "derivation_build_id IS NULL" in definition
    assert "evaluation_id IS NULL" in definition and "derivation_build_id IS NOT NULL" in definition


@pytest.mark.parametrize(
    ("table", "column", "action"),
    [
        ("cluster_member", "cluster_job_id", "c"),  # CASCADE
        ("cluster_attempt", "cluster_job_id", "c"),  # CASCADE
        ("dispatched_job", "cluster_attempt_id", "n"),  # SET NULL
    ],
)
def test_the_foreign_keys_carry_real_delete_actions(table: str, column: str, action: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.confdeltype, c.condeferrable FROM pg_constraint c
            JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
            WHERE c.contype = 'f' AND c.conrelid = %s::regclass AND a.attname = %s
            """,
            [table, column],
        )
        rows = cursor.fetchall()
    assert rows == [(action, True)]


@pytest.mark.parametrize(
    "name",
    [
        "idx-evaluation-queued",
        "idx-evaluation-active",
        "idx-derivation_build-queued",
        "idx-dispatched_job-open-worker",
        "idx-dispatched_job-open-age",
        "idx-cluster_job-queued",
        "idx-cluster_attempt-preparing",
        "idx-worker_session-open",
    ],
)
def test_each_pass_has_a_partial_index_for_its_hot_query(name: str) -> None:
    assert " WHERE " in _indexdef(name)


@pytest.mark.parametrize(("table", "column"), [("derivation_build", "drv_path"), ("cached_path", "path")])
def test_a_store_path_has_its_unique_index_and_no_prefix_search_twin(table: str, column: str) -> None:
    """Migration 0020: nothing searches a prefix of these paths, and every non-HOT update of a build
    wrote the twin's entry too."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s", [table])
        definitions = [row[0] for row in cursor.fetchall()]
    on_column = [d for d in definitions if f"({column}" in d]
    assert any("UNIQUE" in d for d in on_column), on_column
    assert not any("pattern_ops" in d for d in on_column), on_column
