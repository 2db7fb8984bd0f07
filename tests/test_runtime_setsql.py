"""runtime.setsql.from_row: the instance Model.from_db makes, from a fixed-text statement's row."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from django.db.models import signals

from gradient.runtime import setsql
from gradient.runtime.setsql import fixed_cursor
from gradient.scheduling.models import DerivationBuild
from tests.factories import DerivationBuildFactory

FIELDS = tuple(f.attname for f in DerivationBuild._meta.concrete_fields)
SOME = tuple(a for a in FIELDS if a in {"id", "drv_path", "required_features", "outputs", "queued_at"})


def _read(attnames: tuple[str, ...], build_id: Any) -> tuple[Any, ...]:
    with fixed_cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join(attnames)} FROM derivation_build WHERE id = %s",  # noqa: S608 (field names)
            [build_id],
        )
        return cursor.fetchone()


def _same(made: DerivationBuild, loaded: DerivationBuild, attnames: tuple[str, ...]) -> None:
    assert type(made) is DerivationBuild
    assert {a: getattr(made, a) for a in attnames} == {a: getattr(loaded, a) for a in attnames}
    assert made.get_deferred_fields() == loaded.get_deferred_fields()
    assert (made._state.adding, made._state.db) == (False, "default")
    assert made == loaded  # the same row


@pytest.mark.django_db
@pytest.mark.parametrize("attnames", [FIELDS, SOME], ids=["every field", "some fields"])
def test_from_row_makes_what_the_orm_loads(attnames: tuple[str, ...]) -> None:
    build = DerivationBuildFactory(required_features=["kvm", "big-parallel"], outputs={"out": "/nix/store/x"})
    loaded = DerivationBuild.objects.only(*attnames).get(id=build.id)
    made = setsql.from_row(DerivationBuild, attnames, _read(attnames, build.id))
    _same(made, loaded, attnames)
    assert made.required_features == ["kvm", "big-parallel"]  # jsonb decoded as the field decodes it
    # A deferred field is read when asked, as the ORM's instance reads it.
    if "system" not in attnames:
        assert made.system == build.system


@pytest.mark.django_db
def test_from_row_goes_through_init_when_a_receiver_listens() -> None:
    seen: list[Any] = []

    def receiver(sender: Any, instance: Any, **kwargs: Any) -> None:
        seen.append(instance)

    build = DerivationBuildFactory()
    signals.post_init.connect(receiver, sender=DerivationBuild)
    try:
        made = setsql.from_row(DerivationBuild, SOME, _read(SOME, build.id))
    finally:
        signals.post_init.disconnect(receiver, sender=DerivationBuild)
    assert seen == [made]
    _same(made, DerivationBuild.objects.only(*SOME).get(id=build.id), SOME)


def _prepared() -> dict[str, tuple[int, int]]:
    with fixed_cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
        return {statement: (generic, custom) for statement, generic, custom in cursor.fetchall()}


def _setting(name: str) -> str:
    with fixed_cursor() as cursor:
        cursor.execute("SELECT current_setting(%s)", [name])
        return str(cursor.fetchone()[0])


KEYED = "SELECT id FROM derivation_build WHERE id = ANY(%b::uuid[])"


class _RolledBack(Exception):
    """Raised inside a block to roll its transaction back."""


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
def test_a_generic_plan_block_prepares_its_statements_once_and_ends_with_its_transaction() -> None:
    from django.db import transaction

    builds = [DerivationBuildFactory() for _ in range(3)]
    with transaction.atomic(), setsql.generic_plans():
        assert (_setting("plan_cache_mode"), _setting("enable_seqscan")) == ("force_generic_plan", "off")
        assert _setting("jit") == "off"  # a scan priced as disabled must not compile the plan each time
        for build in builds:
            with fixed_cursor() as cursor:
                cursor.execute(KEYED, [[build.id]])
                assert cursor.fetchall() == [(build.id,)]
        with fixed_cursor(literal=True) as cursor:  # planned with its values: not prepared
            cursor.execute(
                "SELECT count(*) FROM derivation_build WHERE id = ANY(%s::uuid[])", [[b.id for b in builds]]
            )
            assert cursor.fetchone() == (3,)
        prepared = _prepared()
    generic, custom = next(plans for text, plans in prepared.items() if "id = ANY($1::uuid[])" in text)
    assert (generic, custom) == (3, 0)  # planned once, run three times
    assert not any("count(*)" in text for text in prepared)
    # Outside the block: PostgreSQL's own choice again, and nothing new prepared.
    assert (_setting("plan_cache_mode"), _setting("enable_seqscan")) == ("auto", "on")
    with transaction.atomic():
        with fixed_cursor() as cursor:
            cursor.execute("SELECT id FROM derivation_build WHERE id = %s", [builds[0].id])
        assert not any("WHERE id = $1" in text for text in _prepared())


@pytest.mark.django_db(transaction=True)
def test_a_thread_reuses_its_cursor_statement_after_statement_but_never_one_in_use() -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the kept cursors are PostgreSQL's (SQLite: Django's own cursor each time)")
    with fixed_cursor() as first:
        first.execute("SELECT 1")
        with fixed_cursor() as inner:  # the outer one is in use: its rows must survive
            inner.execute("SELECT 2")
            assert inner is not first and inner.fetchone() == (2,)
        assert first.fetchone() == (1,)
    with fixed_cursor() as again:
        again.execute("SELECT 3")
        assert again is first and again.fetchone() == (3,)
    with fixed_cursor(literal=True) as literal:
        assert literal is not first
    connection.close()  # a new connection: new cursors on it
    with fixed_cursor() as fresh:
        fresh.execute("SELECT 4")
        assert fresh is not first and fresh.fetchone() == (4,)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("literal", [True, False])
def test_the_generic_plan_settings_hold_from_the_blocks_first_fixed_statement_to_its_end(
    literal: bool,
) -> None:
    from django.db import connection, transaction

    if connection.vendor != "postgresql":
        pytest.skip("plan settings are PostgreSQL's")
    read = "SELECT current_setting('plan_cache_mode'), current_setting('enable_seqscan'), %s::int"
    with transaction.atomic(), setsql.generic_plans():
        with fixed_cursor(literal=literal) as cursor:  # the block's first: the settings come with it
            cursor.execute(read, [7])
            assert cursor.fetchall() == [("force_generic_plan", "off", 7)]
            cursor.execute(read, [8])  # and the cursor goes on as itself
            assert cursor.fetchall() == [("force_generic_plan", "off", 8)]
        with fixed_cursor(literal=not literal) as cursor:
            cursor.execute(read, [9])
            assert cursor.fetchone() == ("force_generic_plan", "off", 9)
    with fixed_cursor() as cursor:  # they ended with the transaction
        cursor.execute(read, [10])
        assert cursor.fetchone() == ("auto", "on", 10)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("literal", [True, False])
def test_a_blocks_transaction_begins_in_its_first_round_trip_and_still_commits_or_rolls_back_whole(
    literal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psycopg's own BEGIN is a round trip of its own; in a generic-plan block it goes with the first
    statement, the reads along with it too, and the block is one transaction all the same."""
    from django.db import connection, transaction

    if connection.vendor != "postgresql":
        pytest.skip("the BEGIN and the plan settings are PostgreSQL's")
    build = DerivationBuildFactory()
    along = "SELECT count(*) FROM derivation_build"
    sent: list[str] = []

    def seen(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql)
        return execute(sql, params, many, context)

    simple_queries: list[str | None] = []
    pipelines: list[int] = []
    real_send_first = setsql._send_first

    def send_first(cursor: Any, begin: str, statement: str | None) -> None:
        simple_queries.append(statement)
        real_send_first(cursor, begin, statement)

    monkeypatch.setattr(setsql, "_send_first", send_first)
    with (
        pytest.raises(_RolledBack),
        transaction.atomic(durable=True),
        setsql.generic_plans(reads_along=[along]),
    ):
        conn = connection.connection
        real_pipeline = conn.pipeline

        def pipeline() -> Any:
            pipelines.append(1)
            return real_pipeline()

        monkeypatch.setattr(conn, "pipeline", pipeline)
        with fixed_cursor(literal=literal) as cursor:
            cursor.execute(
                "UPDATE derivation_build SET drv_path = %s WHERE id = %s"
                # Literal: the transaction began in the simple query that carries this statement.
                # Prepared: BEGIN, the settings and the reads along are statements of their own, sent in
                # one pipeline with it (psycopg's BEGIN would be a round trip of its own).
                " RETURNING transaction_timestamp() = statement_timestamp()",
                ["/changed", build.id],
            )
            assert cursor.fetchall() == [(literal,)]
        # One round trip either way: no message of their own for the BEGIN and the settings.
        assert (simple_queries, pipelines) == (([mock.ANY], []) if literal else ([], [1]))
        if literal:
            assert "UPDATE derivation_build" in str(simple_queries[0])
        assert setsql.read_along(along) == [(1,)]
        assert setsql.read_along(along) is None  # handed out once
        with connection.execute_wrapper(seen):
            DerivationBuild.objects.filter(id=build.id).update(system="changed-too")  # the ORM: inside
        assert sent and not any(s.strip().upper().startswith("BEGIN") for s in sent)
        raise _RolledBack
    build.refresh_from_db()
    assert (build.drv_path, build.system) != ("/changed", "changed-too")  # rolled back, both
    assert connection.connection.autocommit  # Django's autocommit again, psycopg's with it

    with transaction.atomic(durable=True):  # outside a block, psycopg's BEGIN goes on its own
        with fixed_cursor(literal=literal) as cursor:
            cursor.execute("SELECT transaction_timestamp() = statement_timestamp()")
            assert cursor.fetchall() == [(False,)]
    with transaction.atomic(durable=True), setsql.generic_plans():
        with fixed_cursor(literal=literal) as cursor:
            cursor.execute("UPDATE derivation_build SET drv_path = %s WHERE id = %s", ["/changed", build.id])
        DerivationBuild.objects.filter(id=build.id).update(system="changed-too")
    build.refresh_from_db()
    assert (build.drv_path, build.system) == ("/changed", "changed-too")  # committed, both
    assert setsql.read_along(along) is None  # outside a block: nothing


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
@pytest.mark.parametrize("literal", [True, False])
def test_a_first_cursor_left_unused_leaves_the_begin_and_the_settings_to_the_next_statement(
    literal: bool,
) -> None:
    from django.db import transaction

    build = DerivationBuildFactory()

    with pytest.raises(_RolledBack), transaction.atomic(durable=True), setsql.generic_plans():
        with fixed_cursor(literal=literal):
            pass  # nothing sent
        with fixed_cursor(literal=not literal) as cursor:
            cursor.execute(
                "UPDATE derivation_build SET drv_path = %s WHERE id = %s "
                "RETURNING current_setting('plan_cache_mode'), current_setting('enable_seqscan')",
                ["/changed", build.id],
            )
            assert cursor.fetchall() == [("force_generic_plan", "off")]
        raise _RolledBack
    build.refresh_from_db()
    assert build.drv_path != "/changed"  # it was in the block's transaction, rolled back with it


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("postgres_only")
@pytest.mark.parametrize("literal", [True, False])
def test_a_first_statement_that_is_no_execute_still_runs_in_the_blocks_transaction_and_settings(
    literal: bool,
) -> None:
    from django.db import transaction

    builds = [DerivationBuildFactory() for _ in range(2)]

    with pytest.raises(_RolledBack), transaction.atomic(durable=True), setsql.generic_plans():
        with fixed_cursor(literal=literal) as cursor:
            cursor.executemany(
                "UPDATE derivation_build SET drv_path = %s WHERE id = %s",
                [(f"/changed-{b.id}", b.id) for b in builds],
            )
        assert (_setting("plan_cache_mode"), _setting("enable_seqscan")) == ("force_generic_plan", "off")
        raise _RolledBack
    for build in builds:
        build.refresh_from_db()
        assert not build.drv_path.startswith("/changed"), "rolled back with the block's transaction"
