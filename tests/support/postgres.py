"""A PostgreSQL server of the test's own (never the shared one): initdb into a fresh directory, started
and stopped with pg_ctl on a free port, as the `postgres` user when the tests run as root."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import ServeProcess, base_env, free_port, http_json, manage, serve

OPERATOR_PASSWORD = "operator-pw"


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@dataclass
class PostgresServer:
    bin_dir: Path
    data_dir: Path
    port: int
    log_path: Path
    as_user: str | None

    def url(self, database: str = "gradient") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_user:
            command = ["runuser", "-u", self.as_user, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=check)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data_dir), "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data_dir} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-o", options, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop", check=False)

    def createdb(self, name: str = "gradient") -> None:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)


@contextlib.contextmanager
def own_postgres(log_dir: Path) -> Iterator[PostgresServer]:
    """A running PostgreSQL of this test on a free port with a `gradient` database; removed on exit."""
    bin_dir = _bin_dir()
    if bin_dir is None:
        pytest.skip("needs PostgreSQL's initdb and pg_ctl")
    as_user = "postgres" if os.geteuid() == 0 else None
    base = Path(tempfile.mkdtemp(prefix="gradient-pg-"))
    data_dir = base / "data"
    log_path = base / "postgres.log"
    if as_user:
        shutil.chown(base, user=as_user)
    server = PostgresServer(bin_dir, data_dir, free_port(), log_path, as_user)
    try:
        server.init()
        server.start()
        server.createdb()
        yield server
    finally:
        server.stop("immediate")
        with contextlib.suppress(OSError):
            shutil.copy(log_path, log_dir / "postgres.log")
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class OwnService:
    """A `serve` on a PostgreSQL of the test's own (which the test may stop and start) and an operator's
    REST token for it."""

    pg: PostgresServer
    server: ServeProcess
    token: str


@contextlib.contextmanager
def operator_service_on_own_postgres(
    log_dir: Path, *, serve_args: list[str] | None = None, **env: str
) -> Iterator[OwnService]:
    """Migrate a database of its own, create the operator, start `serve` on it (with `env` besides) and
    log the operator in over REST."""
    with own_postgres(log_dir) as pg:
        service_env = base_env(
            DATABASE_URL=pg.url(),
            REDIS_URL="",
            DJANGO_SUPERUSER_USERNAME="operator",
            DJANGO_SUPERUSER_PASSWORD=OPERATOR_PASSWORD,
            DJANGO_SUPERUSER_EMAIL="op@example.com",
            **env,
        )
        manage(["migrate", "--noinput"], service_env)
        manage(["createsuperuser", "--noinput"], service_env)
        with serve(service_env, log_dir, serve_args) as server:
            status, body = http_json(
                "POST",
                f"{server.base_url}/api/v1/auth/token",
                {"username": "operator", "password": OPERATOR_PASSWORD},
            )
            assert status == 200, body
            yield OwnService(pg, server, body["token"])
