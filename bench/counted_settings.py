"""The settings of a benchmark's `serve` that counts its SQL statements (bench/handout.py): gradient's
settings unchanged, plus a count of the statements the process sends through psycopg.

pg_stat_statements needs shared_preload_libraries, so a restart of the shared server, and PostgreSQL 15
counts no statements otherwise; the count is therefore taken where they leave. Counted: each `execute`
(Django's queries, savepoints and health checks included), each parameter set of an `executemany` (one
Execute message each), each COPY and stream, on every psycopg cursor, sync or async. Not counted: the
BEGIN and COMMIT or ROLLBACK psycopg sends around a transaction (pg_stat_database counts the commits).

The count of a process is the 8-byte file `<BENCH_STATEMENT_COUNTS>/<pid>`, mapped in memory and written
at each statement, so that a reader sees the exact figure at any moment; without BENCH_STATEMENT_COUNTS
nothing is counted. The cost, a lock and a write to memory per statement, is well under 1 % of one.

    DJANGO_SETTINGS_MODULE=bench.counted_settings BENCH_STATEMENT_COUNTS=<dir> python manage.py serve
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gradient.settings import *  # noqa: F403

COUNT = struct.Struct("<Q")  # as bench/common.py's read_statement_counts reads it


def _install(directory: Path) -> None:
    import psycopg

    path = directory / str(os.getpid())
    with open(path, "wb") as out:
        out.write(bytes(COUNT.size))
    with open(path, "r+b") as shared:
        memory = mmap.mmap(shared.fileno(), COUNT.size)
    lock = threading.Lock()  # the lanes send statements from several threads
    total = 0

    def add(n: int) -> None:
        nonlocal total
        with lock:
            total += n
            COUNT.pack_into(memory, 0, total)

    def one(method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            add(1)
            return method(self, *args, **kwargs)  # a coroutine or context manager for the async ones

        return counted

    def many(method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any, query: Any, params_seq: Iterable[Any], *args: Any, **kwargs: Any) -> Any:
            params = list(params_seq)
            add(len(params))
            return method(self, query, params, *args, **kwargs)

        return counted

    # The server-side cursors override execute and executemany without calling the base ones.
    for cls in (psycopg.Cursor, psycopg.AsyncCursor, psycopg.ServerCursor, psycopg.AsyncServerCursor):
        for name in ("execute", "copy", "stream"):
            if name in vars(cls):
                setattr(cls, name, one(vars(cls)[name]))
        if "executemany" in vars(cls):
            cls.executemany = many(vars(cls)["executemany"])  # type: ignore[method-assign]


if _directory := os.environ.get("BENCH_STATEMENT_COUNTS"):
    _install(Path(_directory))
