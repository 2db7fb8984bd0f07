"""Set statements the ORM does not write: an UPDATE of many rows that says which rows it changed.

`QuerySet.update` returns a count, so a batch that must know which of its rows changed (which builds
completed, which assignments this batch closed) would read them first with a lock and then update: two
statements. `update_returning` is the one statement, `UPDATE ... WHERE pk IN (...) AND ... RETURNING pk`,
on PostgreSQL and SQLite (3.35 and later) alike, with the values prepared by the model's own fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import connection
from django.db.models import Model


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
