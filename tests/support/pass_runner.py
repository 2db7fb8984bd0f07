"""A pass-runner process for the concurrency tests: `python -m tests.support.pass_runner START SECONDS MODE`.

From the wall-clock time START for SECONDS, it runs the periodic passes back to back and prints one
JSON line per run: {"pass": name, "result": what the run returned}. MODE `tasks` runs every pass of
gradient.schedule.PASSES through its Celery task, under its lease, as Celery beat and the in-process
runner do; MODE `bodies` calls the services the passes wrap directly, with no lease at all (what two
runners do when a lease has expired under a slow pass, or two different passes reach the same rows).
Exit status 0 unless a run raised (its traceback goes to stderr).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def _bodies() -> dict[str, Callable[[], Any]]:
    from django.conf import settings
    from django.utils import timezone

    from gradient.clusters.tasks import _retention
    from gradient.recovery.sweeps import abandoned_dispatch_sweep, evaluation_watchdog
    from gradient.scheduling.services.offers import promote_retries
    from gradient.workers.services import workers_drop_silent

    return {
        "abandoned-dispatch-sweep": lambda: abandoned_dispatch_sweep(now=timezone.now()),
        "evaluation-watchdog": lambda: evaluation_watchdog(now=timezone.now()),
        "cluster-retention": _retention,
        "promote-retries": lambda: promote_retries(now=timezone.now()),
        "worker-liveness": lambda: workers_drop_silent(
            now=timezone.now(), timeout_secs=settings.GRADIENT_PROTO_WORKER_HEARTBEAT_TIMEOUT_SECS
        ),
    }


def main(argv: list[str]) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gradient.settings")
    import django

    django.setup()
    from gradient.celery import app
    from gradient.schedule import PASSES

    start_at, seconds, mode = float(argv[0]), float(argv[1]), argv[2]
    app.loader.import_default_modules()
    if mode == "tasks":
        runs: dict[str, Callable[[], Any]] = {spec.name: app.tasks[spec.task] for spec in PASSES}
    else:
        runs = _bodies()
    while time.time() < start_at:
        time.sleep(0.001)
    deadline = start_at + seconds
    while time.time() < deadline:
        for name, run in runs.items():
            result = run()
            print(json.dumps({"pass": name, "result": result}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
