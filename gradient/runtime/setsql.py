"""Set statements the ORM does not write: an UPDATE of many rows that says which rows it changed, and
the cursor the hot path's fixed-text statements run on (`fixed_cursor`).

`QuerySet.update` returns a count, so a batch that must know which of its rows changed (which builds
completed, which assignments this batch closed) would read them first with a lock and then update: two
statements. `update_returning` is the one statement, `UPDATE ... WHERE pk IN (...) AND ... RETURNING pk`,
on PostgreSQL and SQLite (3.35 and later) alike, with the values prepared by the model's own fields.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import psycopg
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import Model, signals
from django.db.models.base import ModelState


@contextmanager
def fixed_cursor(*, literal: bool = False) -> Iterator[Any]:
    """A cursor on the default connection, in its transaction, for statements written as fixed text
    (the claim, the fence, the report batch's set statements): on PostgreSQL a plain psycopg cursor, so
    the parameters travel apart from the text (server-side binding: arrays of thousands of ids are not
    quoted into the statement in Python, as Django's client-side cursor does; with `%b` an array of JSON
    texts is sent in binary, with nothing to escape) and timestamps are read by psycopg's own C loader
    instead of Django's Python one. The rows read are the same: aware datetimes in the session's time
    zone (UTC, which Django sets), uuids, ints. Errors come out as Django's (OperationalError and the
    rest), as from `connection.cursor()`. Elsewhere (SQLite) it is `connection.cursor()`.

    Inside a `generic_plans` block its statements are prepared (once per connection and statement text)
    and run their generic plan; outside, they are planned with their values each time. With `literal`,
    the values are written into the statement (psycopg's client-side binding), so it is planned with
    them each time, whatever the transaction asked: for a statement whose generic plan would be bad
    (the queue's heads: its generic plan read every Queued build)."""
    wrapper = connections[DEFAULT_DB_ALIAS]  # looked up once: each `connection.x` looks it up again
    if wrapper.vendor != "postgresql":
        with wrapper.cursor() as django_cursor:
            yield django_cursor
        return
    wrapper.ensure_connection()
    conn = wrapper.connection
    if conn.prepare_threshold is None:
        # Django turns psycopg's preparing off (its own cursors bind on the client and never prepare);
        # on, with a threshold never reached, only what is asked for is prepared (psycopg ignores
        # prepare=True while it is off).
        conn.prepare_threshold = _ONLY_WHEN_ASKED
    with wrapper.wrap_database_errors:
        generic = getattr(_generic, "on", False)
        kind = psycopg.ClientCursor if literal else _PreparingCursor if generic else psycopg.Cursor
        cursor, kept = _cursor(conn, kind)
        try:
            if generic and _generic.pending:
                _generic.pending = False
                begin = _begin_here(conn)
                # Literal: the settings go in front of this statement, in its simple query. Prepared:
                # the BEGIN, the settings and the reads along are statements of their own, sent with
                # it in one pipeline. Either way one round trip, whose results are the statement's.
                first: _FirstStatement = (
                    _SettingsFirst(cursor, conn, begin)
                    if isinstance(cursor, psycopg.ClientCursor)
                    else _PipelinedFirst(cursor, conn, begin)
                )
                yield first
                if first.unsent:  # nothing went: the block's next statement sends all that instead
                    _generic.pending = True
                    if begin:
                        conn.autocommit = False
                return
            yield cursor
        finally:
            if kept:
                _cursors.busy.discard(kind)
            else:
                cursor.close()


# This thread's cursors on its connection, one of each kind, made once and used for statement after
# statement (a cursor, its adapters map and its loader made per statement were a tenth of a report
# batch's Python); one used by a caller further up (a fixed_cursor inside another) is not shared.
_cursors = threading.local()


def _cursor(conn: psycopg.Connection[Any], kind: type) -> tuple[psycopg.Cursor[Any], bool]:
    """A cursor of `kind` on `conn`, and whether it is this thread's kept one (else a new one to close)."""
    if getattr(_cursors, "conn", None) is not conn:  # a new connection (or a first call): start afresh
        _cursors.conn, _cursors.kept, _cursors.busy = conn, {}, set()
    kept: dict[type, psycopg.Cursor[Any]] = _cursors.kept
    busy: set[type] = _cursors.busy
    if kind in busy:
        return _new_cursor(conn, kind), False
    cursor = kept.get(kind)
    if cursor is None or cursor.closed:
        cursor = kept[kind] = _new_cursor(conn, kind)
    busy.add(kind)
    return cursor, True


def _new_cursor(conn: psycopg.Connection[Any], kind: type) -> psycopg.Cursor[Any]:
    cursor: psycopg.Cursor[Any] = kind(conn)
    cursor.adapters.register_loader(_TIMESTAMPTZ_OID, _timestamptz_loader())
    return cursor


_ONLY_WHEN_ASKED = 2**31 - 1


class _PreparingCursor(psycopg.Cursor[Any]):
    """A psycopg cursor whose statements are prepared unless an execute says otherwise (Django turns
    psycopg's automatic preparing off on its connections)."""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Any:
        return super().execute(query, params, prepare=True if prepare is None else prepare, binary=binary)


@contextmanager
def generic_plans(reads_along: Sequence[str] = ()) -> Iterator[None]:
    """Inside a transaction: its fixed-text statements from here to the end of the block are prepared
    and run their generic plan, made once per connection and statement, instead of being planned again
    with their values (PostgreSQL keeps choosing custom plans for statements whose parameters are
    arrays, as the hot path's are: their planning was a fifth of its time, more than running them for
    some). For the hot path's batches (a claim batch, a report batch), whose statements read and write
    rows by their keys; a statement that needs its values to be planned well runs `literal`. Outside
    such a block fixed-text statements are neither prepared nor planned generically (PostgreSQL's own
    choice would take a generic plan made for a hundred rows for an ingest's thousands). The settings
    end with the transaction (set_config local); nothing on SQLite."""
    if connection.vendor != "postgresql":
        yield
        return
    # Sent with the block's first fixed-text statement (in its round trip when that one is `literal`, as
    # a claim batch's first read is), not on their own: nothing before it is prepared. So are the
    # transaction's BEGIN, when nothing was sent in it yet (`_begin_here`), and `reads_along`.
    _generic.on, _generic.pending = True, True
    _generic.riders, _generic.ridden = tuple(reads_along), {}
    try:
        yield
    finally:
        _generic.on = _generic.pending = False
        _generic.riders, _generic.ridden = (), {}


def read_along(sql: str) -> list[tuple[Any, ...]] | None:
    """The rows of `sql` if it was one of the `reads_along` of the generic-plans block under way and went
    with its first statement (each is handed out once); None otherwise: the caller reads it itself."""
    ridden = getattr(_generic, "ridden", None)
    return ridden.pop(sql, None) if ridden else None


def _begin_here(conn: psycopg.Connection[Any]) -> str:
    """BEGIN for the caller's round trip when psycopg would send it in one of its own: the transaction
    Django opened has sent nothing yet. psycopg then runs in autocommit until Django's atomic block ends:
    it sends no BEGIN of its own for a transaction the server already has open, and it still sends
    COMMIT or ROLLBACK for it (it goes by the server's transaction status); Django turns autocommit
    back on at the end of its outermost block, as always. Nothing ran in between, so every statement
    of the block is in the transaction."""
    if conn.autocommit or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return ""
    conn.autocommit = True
    return "BEGIN; "


def _send_first(cursor: psycopg.Cursor[Any], begin: str, statement: str | None) -> None:
    """One simple query: `begin`, the generic-plan settings, the block's reads along (their rows kept for
    read_along) and `statement` if any, on whose result the cursor is left."""
    riders: tuple[str, ...] = _generic.riders
    parts = [f"{begin}{_GENERIC_PLANS}", *riders]
    if statement is not None:
        parts.append(statement)
    cursor.execute("; ".join(parts))
    if begin:
        cursor.nextset()  # past BEGIN's result, to the settings'
    for sql in riders:
        cursor.nextset()
        _generic.ridden[sql] = cursor.fetchall()
    if statement is not None:
        cursor.nextset()


_generic = threading.local()


class _FirstStatement:
    """The cursor of a generic-plan block's first fixed-text statement: its first `execute` carries the
    transaction's BEGIN (if it is still to be sent), the generic-plan settings and the reads along in
    its own round trip (`_send_with`); anything else used first (executemany, copy) gets them in a round
    trip of their own before it. Everything else is the cursor's."""

    def __init__(self, cursor: psycopg.Cursor[Any], conn: psycopg.Connection[Any], begin: str) -> None:
        self._cursor = cursor
        self._conn = conn
        self._begin = begin
        self._first = True

    @property
    def unsent(self) -> bool:
        return self._first

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if not self._first:
            return self._cursor.execute(query, params, **kwargs)
        self._first = False
        self._send_with(query, params, kwargs)
        return self._cursor

    def _send_with(self, query: Any, params: Any, kwargs: dict[str, Any]) -> None:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if self._first:
            self._first = False
            plain, kept = _cursor(self._conn, psycopg.Cursor)
            try:
                _send_first(plain, self._begin, None)
            finally:
                if kept:
                    _cursors.busy.discard(psycopg.Cursor)
                else:
                    plain.close()
        return getattr(self._cursor, name)


class _SettingsFirst(_FirstStatement):
    """A client-side (literal) cursor: the statement, bound here, goes last in one simple query."""

    def _send_with(self, query: Any, params: Any, kwargs: dict[str, Any]) -> None:
        assert isinstance(self._cursor, psycopg.ClientCursor)
        text = self._cursor.mogrify(query, params)  # client-side binding, as the cursor's own execute
        _send_first(self._cursor, self._begin, text)


class _PipelinedFirst(_FirstStatement):
    """A prepared statement's cursor: BEGIN, the settings and the reads along are statements of their
    own, sent with it in one psycopg pipeline (one sync for the lot)."""

    def _send_with(self, query: Any, params: Any, kwargs: dict[str, Any]) -> None:
        conn = self._conn
        riders: tuple[str, ...] = _generic.riders
        with conn.pipeline():
            if self._begin:
                conn.execute("BEGIN")
            conn.execute(_GENERIC_PLANS)
            along = [(sql, conn.execute(sql)) for sql in riders]
            self._cursor.execute(query, params, **kwargs)
        for sql, rows in along:
            _generic.ridden[sql] = rows.fetchall()


# Both for the rest of the transaction, in one round trip. A generic plan is made once per connection
# and kept until a table it reads is analyzed again: one made while a table was nearly empty (a fresh
# database, the first minute) would scan it whole ever after; with sequential scans off, each keyed
# read or write is planned on its index, whatever the statistics said then. No JIT: these statements
# touch a few rows each, and a table read whole anyway (a one-row table with no index to use) costs as
# much as sequential scans off make it, enough to compile the plan at every execution (1.5 s a claim
# batch, measured, when the claim statement first read the cluster reservation).
_GENERIC_PLANS = (
    "SELECT set_config('plan_cache_mode', 'force_generic_plan', true), "
    "set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)"
)

_TIMESTAMPTZ_OID = 1184


@functools.cache
def _timestamptz_loader() -> type:
    """psycopg's own loader of timestamptz text (its C one, when psycopg runs with its C speedups)."""
    from psycopg.pq import Format

    return psycopg.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT)  # type: ignore[return-value]


def from_row(model: type[Model], attnames: Sequence[str], values: Sequence[Any]) -> Any:
    """An instance of `model` from a row of a fixed-text statement whose columns are `attnames`, in the
    model's field order (Model.from_db's rule). Django reads jsonb as text and decodes it in the field
    (a converter Model.from_db does not run): the JSON fields are decoded here as the field would.

    The instance is the one Model.from_db makes (the columns read set, the others deferred, not adding,
    on the default database), made without Model.__init__ where no pre_init/post_init receiver would
    see it: the hot path makes several per hand-out, and __init__'s generic path was most of their
    cost."""
    row = list(values)
    for i in _json_positions(model, tuple(attnames)):
        if isinstance(row[i], str):
            row[i] = _decode_json(row[i])
    if signals.pre_init.receivers or signals.post_init.receivers:
        return model.from_db(connection.alias, list(attnames), row)
    instance = model.__new__(model)
    # A fresh instance has no cached related objects, so the attnames' descriptors would only store
    # the values (ForeignKeyDeferredAttribute clears a cache that is empty here).
    instance.__dict__.update(zip(attnames, row, strict=True))
    state = instance._state = ModelState()
    state.adding = False
    state.db = connection.alias
    return instance


_decode_json = msgspec.json.Decoder().decode  # what json.loads gives, faster


@functools.cache
def _json_positions(model: type[Model], attnames: tuple[str, ...]) -> tuple[int, ...]:
    kinds = {f.attname: f.get_internal_type() for f in model._meta.concrete_fields}
    return tuple(i for i, name in enumerate(attnames) if kinds.get(name) == "JSONField")


def update_returning(
    model: type[Model],
    pks: Sequence[Any],
    values: Mapping[str, Any],
    where: Mapping[str, Any] | None = None,
) -> set[Any]:
    """Set `values` (field name -> value) on the rows of `model` whose primary key is in `pks` and whose
    fields equal `where` (a value of None: IS NULL); returns the primary keys of the rows changed."""
    if not pks:
        return set()
    meta = model._meta
    pk = meta.pk
    assert pk is not None  # every model has one

    def column(name: str) -> tuple[str, Any]:
        field: Any = meta.get_field(name)
        return connection.ops.quote_name(field.column), field

    assignments, params = [], []
    for name, value in values.items():
        col, field = column(name)
        assignments.append(f"{col} = %s")
        params.append(field.get_db_prep_save(value, connection))
    conditions = [f"{connection.ops.quote_name(pk.column)} IN ({', '.join(['%s'] * len(pks))})"]
    params.extend(pk.get_db_prep_value(value, connection) for value in pks)
    for name, value in (where or {}).items():
        col, field = column(name)
        if value is None:
            conditions.append(f"{col} IS NULL")
        else:
            conditions.append(f"{col} = %s")
            params.append(field.get_db_prep_value(value, connection))
    sql = (
        f"UPDATE {connection.ops.quote_name(meta.db_table)} SET {', '.join(assignments)} "  # noqa: S608
        f"WHERE {' AND '.join(conditions)} RETURNING {connection.ops.quote_name(pk.column)}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {pk.to_python(row[0]) for row in cursor.fetchall()}
