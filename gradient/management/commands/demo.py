"""`python manage.py demo`: the service, three workers and a few sample evaluations, so a new user
watches jobs flow through the admin within a minute. Stop it with Ctrl-C or SIGTERM (`kill <pid>`): either
stops the server and the workers too. With the simulated executor it keeps a trickle of sample work
going (`--trickle-secs`, one evaluation every 20 s by default), so there is always something live to
look at.

It runs `serve` and three reference workers as child processes on this machine, against whatever
database the settings name (the embedded SQLite file by default). With `--executor sim` (the default)
the workers simulate Nix and the samples are `sim:` graphs. With `--executor nix` they run this
machine's Nix (a local store, no daemon: Debian's nix-bin will do) on the example flakes of
examples/flakes, each copied under var/demo-flakes/ as a fresh git repository; `demo-c` then stands in
for an aarch64-linux builder (`--arch aarch64-linux`, and its Nix told `extra-platforms =
aarch64-linux`) and builds the multi-system flake's aarch64 half.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from gradient.examples import EXAMPLES, example_repository
from gradient.scheduling.models import Project
from gradient.scheduling.services.evaluations import evaluation_create
from gradient.workers.executors import ExecutorUnavailable, make_executor
from gradient.workers.executors.nix_parse import OFFLINE_NIX_CONFIG
from gradient.workers.models import Worker
from gradient.workers.services import worker_activate, worker_register, worker_token_reset

SAMPLES = (
    "sim:diamond?duration_ms=3000",
    "sim:chain?n=4&duration_ms=2000",
    "sim:wide?n=12&duration_ms=1500",
    "sim:chain?n=3&duration_ms=1000&fail=chain-1",  # a failing build: its evaluation ends Failed
    "sim:chain?n=2&system=aarch64-linux",  # no aarch64 worker: it waits, and says why
)
WORKERS = (("demo-a", "zone-a"), ("demo-b", "zone-a"), ("demo-c", "zone-b"))
NIX_ARM_WORKER = "demo-c"
# The trickle cycles through the samples that finish (not the failing or the waiting one), each with a
# fresh salt: new store paths, so it builds instead of reusing what an earlier one built.
TRICKLE = SAMPLES[:3]
TRICKLE_SECS = 20.0
# A worker that stopped is started again after this long: a deactivated one is refused (403) and stops
# at once, so the demo retries it until an operator activates it again, and keeps everything else running.
RESTART_AFTER_SECS = 10.0
UP_AFTER_SECS = 5.0  # a restarted worker still running after this long has been let in
WORKER_EXIT_MEANINGS = {
    2: "its configuration was refused",
    3: "the server refused it (deactivated, or its token reissued)",
}


def last_error(log: Path) -> str:
    """The last ERROR line of a log (without its timestamp), or "" when there is none."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-200:]
    except OSError:
        return ""
    for line in reversed(lines):
        if " ERROR " in line:
            return line.split(" ERROR ", 1)[1].strip()
    return ""


@dataclass
class DemoWorker:
    """One demo worker process, started again after it stops (see RESTART_AFTER_SECS)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None
    restart_at: float | None = None
    stopped: int = 0
    last_reason: str = field(default="")
    started_at: float = 0.0

    def start(self, *, now: float = 0.0) -> None:
        self.restart_at = None
        self.started_at = now
        self.process = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            # A fresh log on the first start (an earlier demo's errors are not this one's), then appended.
            stdout=open(self.log, "ab" if self.stopped else "wb"),  # noqa: SIM115 (lives with the child)
            stderr=subprocess.STDOUT,
        )

    def why_stopped(self, code: int) -> str:
        meaning = WORKER_EXIT_MEANINGS.get(code, "it stopped")
        detail = last_error(self.log)
        return f"{meaning}: {detail}" if detail else f"{meaning} (see {self.log.name})"


def supervise(workers: list[DemoWorker], *, now: float) -> Iterator[str]:
    """One look at the demo's workers: says which stopped and why, and starts each again when its wait
    is over. Yields the messages for the operator."""
    for worker in workers:
        if worker.restart_at is not None:
            if now >= worker.restart_at:
                worker.start(now=now)
            continue
        code = worker.process.poll() if worker.process is not None else 0
        if code is None:
            if worker.last_reason and now - worker.started_at >= UP_AFTER_SECS:
                worker.last_reason = ""
                yield f"worker {worker.name} is running again"
            continue
        worker.stopped += 1
        worker.restart_at = now + RESTART_AFTER_SECS
        reason = worker.why_stopped(code)
        if reason == worker.last_reason:
            continue  # still refused: said once, retried quietly
        worker.last_reason = reason
        yield (
            f"worker {worker.name} stopped (exit {code}): {reason}; "
            f"the demo keeps running and starts it again every {RESTART_AFTER_SECS:.0f} s until it stays up"
        )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def trickle_sample(n: int) -> str:
    """The n-th trickled sample (from 1): the finishing samples in turn, each with its own salt."""
    return f"{TRICKLE[(n - 1) % len(TRICKLE)]}&salt=trickle-{n}"


def demo_nix_config(*extra: str) -> str:
    """The demo workers' NIX_CONFIG: the operator's own, then a local store without sandbox, build
    users or network (the example flakes need nothing else)."""
    lines = [os.environ.get("NIX_CONFIG", "").rstrip("\n"), OFFLINE_NIX_CONFIG, *extra]
    return "\n".join(line for line in lines if line) + "\n"


class Command(BaseCommand):
    help = "Run the service with three workers (simulated or real Nix) and submit sample evaluations."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--trickle-secs",
            type=float,
            default=TRICKLE_SECS,
            help="with --executor sim, submit one more sample evaluation this often (0: none)",
        )
        parser.add_argument(
            "--executor",
            choices=("sim", "nix"),
            default="sim",
            help="sim: simulated Nix and sim: graphs (default); nix: this machine's Nix and examples/flakes",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # SIGTERM stops the demo as Ctrl-C does: the `finally` below stops the server and the workers.
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self._run(**options)
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self, **options: Any) -> None:
        port = options["port"]
        trickle_secs = options["trickle_secs"] if options["executor"] == "sim" else 0.0
        executor = options["executor"]
        root = Path(settings.BASE_DIR)
        worker_env: dict[str, dict[str, str]] = {name: dict(os.environ) for name, _ in WORKERS}
        if executor == "nix":
            try:
                make_executor("nix")  # says at once when Nix is missing or broken
            except ExecutorUnavailable as exc:
                raise CommandError(str(exc)) from None
            if shutil.which("git") is None:
                raise CommandError("the nix demo commits the example flakes to git repositories: install git")
            for name, _ in WORKERS:
                extra = ["extra-platforms = aarch64-linux"] if name == NIX_ARM_WORKER else []
                worker_env[name]["NIX_CONFIG"] = demo_nix_config(*extra)
        user_model = get_user_model()
        if not user_model.objects.filter(username="admin").exists():
            user_model.objects.create_superuser("admin", "admin@example.invalid", "admin")
        project, _ = Project.objects.get_or_create(name="demo")
        credentials = self._prepare_workers(project)

        serve: subprocess.Popen[bytes] | None = None
        workers: list[DemoWorker] = []
        logs = root / "var"
        try:
            # The workers share this machine with the server, so their CPU figures are the server's too:
            # the demo scores with the `simple` policy (no ResourceSaturation) unless told otherwise.
            serve_env = {
                **os.environ,
                "GRADIENT_SCHEDULING_POLICY": os.environ.get("GRADIENT_SCHEDULING_POLICY", "simple"),
            }
            serve = subprocess.Popen(
                [sys.executable, "manage.py", "serve", "--port", str(port)],
                cwd=root,
                env=serve_env,
                stdout=open(logs / "demo-serve.log", "wb"),  # noqa: SIM115 (lives as long as the child)
                stderr=subprocess.STDOUT,
            )
            self._wait_for(f"http://127.0.0.1:{port}/healthz")
            for worker_id, token, zone, name in credentials:
                # sim: every worker an x86_64-linux builder; nix: what the local Nix says, but demo-c
                # stands in for an aarch64-linux machine.
                arch = "aarch64-linux" if executor == "nix" and name == NIX_ARM_WORKER else "x86_64-linux"
                workers.append(
                    DemoWorker(
                        name=name,
                        argv=[
                            sys.executable,
                            "-m",
                            "gradient.workers.client",
                            "--server",
                            f"ws://127.0.0.1:{port}/proto",
                            "--worker-id",
                            worker_id,
                            "--executor",
                            executor,
                            *(["--arch", arch] if executor == "sim" or arch != "x86_64-linux" else []),
                            "--slots",
                            "2",
                            "--zone",
                            zone,
                        ],
                        # The token travels in the environment, not on the command line, where `ps`
                        # would show it to every user of the machine.
                        env={**worker_env[name], "GRADIENT_WORKER_TOKEN": token},
                        cwd=root,
                        log=logs / f"{name}.log",
                    )
                )
            for worker in workers:
                worker.start(now=time.monotonic())
            for url, commit, wildcards in self._samples(executor, logs / "demo-flakes"):
                evaluation_create(
                    project=project, repository=url, commit=commit, wildcards=wildcards, now=timezone.now()
                )
            self.stdout.write(
                f"Gradient demo running: http://127.0.0.1:{port}/admin/ (user admin, password admin).\n"
                f"Evaluations: http://127.0.0.1:{port}/admin/scheduling/evaluation/ ; "
                f"workers log to var/demo-*.log. Ctrl-C (or SIGTERM) stops everything."
            )
            trickled = 0
            next_trickle = time.monotonic() + trickle_secs
            while (code := serve.poll()) is None:
                for message in supervise(workers, now=time.monotonic()):
                    self.stderr.write(message)
                if trickle_secs > 0 and time.monotonic() >= next_trickle:
                    trickled += 1
                    evaluation_create(
                        project=project,
                        repository=trickle_sample(trickled),
                        commit="demo",
                        now=timezone.now(),
                    )
                    next_trickle = time.monotonic() + trickle_secs
                time.sleep(1)
            why = last_error(logs / "demo-serve.log") or "see var/demo-serve.log"
            self.stderr.write(f"the server stopped (exit {code}): {why}; stopping the workers")
        except KeyboardInterrupt:
            pass
        finally:
            children = [w.process for w in workers if w.process is not None]
            if serve is not None:
                children.insert(0, serve)
            for child in reversed(children):
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in children:
                try:
                    child.wait(25)
                except subprocess.TimeoutExpired:
                    child.kill()

    def _prepare_workers(self, project: Project) -> list[tuple[str, str, str, str]]:
        """(id, token, zone, name) of each demo worker, registered on first use. A demo worker an operator
        deactivated in an earlier run is active again: the demo starts its own workers, and says so."""
        credentials = []
        for name, zone in WORKERS:
            worker = Worker.objects.filter(name=name).first()
            if worker is None:
                worker, token = worker_register(name=name, projects=[project])
            else:
                token = worker_token_reset(worker_id=worker.id) or ""
                if not worker.active:
                    worker_activate(worker_id=worker.id)
                    self.stdout.write(f"{name} was deactivated: the demo activates its own workers again")
            credentials.append((str(worker.id), token, zone, name))
        return credentials

    @staticmethod
    def _samples(executor: str, flakes: Path) -> list[tuple[str, str, list[str]]]:
        """(repository, commit, wildcards) of each sample evaluation."""
        if executor == "sim":
            return [(url, "demo", []) for url in SAMPLES]
        # Fresh copies with a new salt: the store may hold an earlier demo's outputs.
        flakes.mkdir(parents=True, exist_ok=True)
        samples = []
        for name, wildcards in EXAMPLES.items():
            directory, commit = example_repository(name, flakes)
            samples.append((str(directory), commit, wildcards))
        return samples

    @staticmethod
    def _wait_for(url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=1):  # noqa: S310 (loopback)
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{url} did not answer in {timeout:.0f} s")
