"""`python manage.py demo`: the service, three simulated workers and a few sample evaluations, so a new
user watches jobs flow through the admin within a minute. Stop it with Ctrl-C.

It runs `serve` and three reference workers (`--executor sim`) as child processes on this machine,
against whatever database the settings name (the embedded SQLite file by default).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.utils import timezone

from gradient.scheduling.models import Project
from gradient.scheduling.services.evaluations import evaluation_create
from gradient.workers.models import Worker
from gradient.workers.services import worker_register, worker_token_reset

SAMPLES = (
    "sim:diamond?duration_ms=3000",
    "sim:chain?n=4&duration_ms=2000",
    "sim:wide?n=12&duration_ms=1500",
    "sim:chain?n=3&duration_ms=1000&fail=chain-1",  # a failing build: its evaluation ends Failed
    "sim:chain?n=2&system=aarch64-linux",  # no aarch64 worker: it waits, and says why
)
WORKERS = (("demo-a", "zone-a"), ("demo-b", "zone-a"), ("demo-c", "zone-b"))


class Command(BaseCommand):
    help = "Run the service with three simulated workers and submit sample evaluations."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args: Any, **options: Any) -> None:
        port = options["port"]
        root = Path(settings.BASE_DIR)
        user_model = get_user_model()
        if not user_model.objects.filter(username="admin").exists():
            user_model.objects.create_superuser("admin", "admin@example.invalid", "admin")
        project, _ = Project.objects.get_or_create(name="demo")
        credentials = []
        for name, zone in WORKERS:
            worker = Worker.objects.filter(name=name).first()
            if worker is None:
                worker, token = worker_register(name=name, projects=[project])
            else:
                token = worker_token_reset(worker_id=worker.id) or ""
            credentials.append((str(worker.id), token, zone, name))

        children: list[subprocess.Popen[bytes]] = []
        logs = root / "var"
        try:
            # The workers share this machine with the server, so their CPU figures are the server's too:
            # the demo scores with the `simple` policy (no ResourceSaturation) unless told otherwise.
            serve_env = {
                **os.environ,
                "GRADIENT_SCHEDULING_POLICY": os.environ.get("GRADIENT_SCHEDULING_POLICY", "simple"),
            }
            children.append(
                subprocess.Popen(
                    [sys.executable, "manage.py", "serve", "--port", str(port)],
                    cwd=root,
                    env=serve_env,
                    stdout=open(logs / "demo-serve.log", "wb"),  # noqa: SIM115 (lives as long as the child)
                    stderr=subprocess.STDOUT,
                )
            )
            self._wait_for(f"http://127.0.0.1:{port}/healthz")
            for worker_id, token, zone, name in credentials:
                children.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "gradient.workers.client",
                            "--server",
                            f"ws://127.0.0.1:{port}/proto",
                            "--worker-id",
                            worker_id,
                            "--token",
                            token,
                            "--executor",
                            "sim",
                            "--arch",
                            "x86_64-linux",
                            "--slots",
                            "2",
                            "--zone",
                            zone,
                        ],
                        cwd=root,
                        stdout=open(logs / f"{name}.log", "wb"),  # noqa: SIM115
                        stderr=subprocess.STDOUT,
                    )
                )
            for url in SAMPLES:
                evaluation_create(project=project, repository=url, commit="demo", now=timezone.now())
            self.stdout.write(
                f"Gradient demo running: http://127.0.0.1:{port}/admin/ (user admin, password admin).\n"
                f"Evaluations: http://127.0.0.1:{port}/admin/scheduling/evaluation/ ; "
                f"workers log to var/demo-*.log. Ctrl-C stops everything."
            )
            while all(child.poll() is None for child in children):
                time.sleep(1)
            self.stderr.write("a demo process exited; stopping")
        except KeyboardInterrupt:
            pass
        finally:
            for child in reversed(children):
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in children:
                try:
                    child.wait(25)
                except subprocess.TimeoutExpired:
                    child.kill()

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
