"""Real processes for end-to-end tests: `manage.py serve` and reference workers, on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (loopback only)
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class ServeProcess:
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/proto"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def manage(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 300) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def base_env(**overrides: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Server and workers share this machine, so the workers' CPU figures are the whole machine's: under
    # the resource-aware policy the tests' own load would read as saturation and nothing would be handed
    # out. End-to-end runs score with `simple`; ResourceSaturation has its own tests.
    env.setdefault("GRADIENT_SCHEDULING_POLICY", "simple")
    # Seen is written by the presence flush (every 2 s in production); end-to-end tests judge liveness
    # with time-outs of a few seconds, so their servers flush more often.
    env.setdefault("GRADIENT_PRESENCE_FLUSH_SECS", "0.25")
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def database_env(*, redis: bool = True, **overrides: str | None) -> dict[str, str]:
    """The environment of `serve`, workers and Celery on the test's own PostgreSQL database (and its
    Redis, unless `redis` is False: then the channel layer and the passes are in-process). Skips the
    test without them."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql" or (redis and not settings.REDIS_URL):
        pytest.skip("needs PostgreSQL" + (" and Redis" if redis else ""))
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    values: dict[str, str | None] = {"DATABASE_URL": url, "REDIS_URL": settings.REDIS_URL if redis else ""}
    values.update(overrides)
    return base_env(**values)


def operator_token(server: ServeProcess, username: str = "operator") -> str:
    """A staff user and its REST token from `server` (the test's database must be the server's)."""
    from django.contrib.auth.models import User

    User.objects.create_user(username, password=f"{username}-pw", is_staff=True)
    status, body = http_json(
        "POST", f"{server.base_url}/api/v1/auth/token", {"username": username, "password": f"{username}-pw"}
    )
    assert status == 200, body
    return str(body["token"])


@contextlib.contextmanager
def serve(
    env: dict[str, str],
    log_dir: Path,
    extra_args: list[str] | None = None,
    ready_timeout: float = 60.0,
    port: int | None = None,
) -> Iterator[ServeProcess]:
    """Start `manage.py serve` on `port` (a free one by default) and wait until /healthz answers 200. A
    second boot on the port of a killed one is where its workers reconnect."""
    port = port or free_port()
    log_path = log_dir / f"serve-{port}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", str(port), *(extra_args or [])],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServeProcess(port=port, process=process, log_path=log_path, env=env)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"serve exited with {process.returncode}:\n{server.log()}")
            try:
                status, _ = http_get(f"{server.base_url}/healthz", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve did not answer /healthz in {ready_timeout}s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        server.stop()


def http_json(
    method: str, url: str, body: Any = None, token: str | None = None, timeout: float = 10.0
) -> tuple[int, Any]:
    """A JSON request (with `Authorization: Token ...` when given); returns (status, decoded body)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)  # noqa: S310 (loopback only)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Token {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    return status, json.loads(raw) if raw else None


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.2, what: str = "") -> T:
    """Poll until `predicate()` is truthy; returns its value, or fails naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


@dataclass
class WorkerProcess:
    """A reference worker, `python -m gradient.workers.client`."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pause(self) -> None:
        """SIGSTOP: it stops heartbeating, its socket stays open."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


@contextlib.contextmanager
def reference_worker(
    server_url: str,
    worker_id: str,
    token: str,
    log_dir: Path,
    *,
    name: str = "worker",
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    executor: str = "sim",
) -> Iterator[WorkerProcess]:
    """Start a reference worker with the `executor` (sim by default) against `server_url`
    (ws://.../proto); stopped with SIGTERM on exit."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradient.workers.client",
                "--server",
                server_url,
                "--worker-id",
                worker_id,
                "--executor",
                executor,
                *(extra_args or []),
            ],
            cwd=ROOT,
            # The token in the environment, as docs/workers.md says: a command line is anyone's to read.
            env={**(env if env is not None else base_env()), "GRADIENT_WORKER_TOKEN": token},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = WorkerProcess(name=name, process=process, log_path=log_path)
    try:
        yield worker
    finally:
        worker.stop()


@dataclass
class CeleryProcess:
    """`celery -A gradient worker -B`: a Celery worker with its embedded beat (DatabaseScheduler)."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


@contextlib.contextmanager
def celery_worker(
    env: dict[str, str], log_dir: Path, *, name: str = "celery", concurrency: int = 2
) -> Iterator[CeleryProcess]:
    """Start a real Celery worker with beat on the broker of env["REDIS_URL"], running the passes of
    gradient.schedule through django-celery-beat's DatabaseScheduler; stopped with SIGTERM (warm
    shutdown) on exit. Tasks left in the queue by an earlier run are purged first."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "gradient",
                "worker",
                "-B",
                "--scheduler",
                "django_celery_beat.schedulers:DatabaseScheduler",
                "--loglevel",
                "INFO",
                "--concurrency",
                str(concurrency),
                "--hostname",
                f"{name}-{os.getpid()}@%h",
                "--without-gossip",
                "--without-mingle",
                "--purge",
            ],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = CeleryProcess(process=process, log_path=log_path)
    try:
        yield worker
    finally:
        worker.stop()
