"""A part of the caller's transaction that fails alone: a savepoint, not a transaction of its own.

The entry function owns the transaction (`atomic(durable=True)`); what runs below it and may fail on its
own (one report of a batch, one claim of a RequestJob or of a cluster) runs in `part()`. On an error
the part is rolled back to its savepoint and the error goes on; the rest of the transaction stands.

Django's own ORM writes mark the whole transaction for rollback when they fail (`needs_rollback`, which
then refuses every statement, the ROLLBACK TO SAVEPOINT included); the part clears that mark first,
since the savepoint undoes exactly what failed. Outside a transaction (autocommit) there is no
savepoint: each statement commits on its own, and the part only passes the error on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import transaction


@contextmanager
def part() -> Iterator[None]:
    sid = transaction.savepoint()
    try:
        yield
    except BaseException:
        if sid is not None:
            transaction.set_rollback(False)
            transaction.savepoint_rollback(sid)
        raise
    if sid is not None:
        transaction.savepoint_commit(sid)
