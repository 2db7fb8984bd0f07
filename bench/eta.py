"""How good the start estimates are (issue 33): a simulated fleet takes a queue of builds whose durations
come from a fixed distribution per derivation, the ETA pass estimates each build's start while it waits,
and the estimate is compared with the hand-out.

    .venv/bin/python bench/eta.py [--builds 2000] [--workers 20] [--names 40] [--history 10]
                                  [--min-ms 200] [--max-ms 2000] [--spread 0.3] [--min-wait 2]
                                  [--pass-secs 0.5] [--settle-secs 10]

1. The tables reset (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/gradient_bench:
   point it at a database of your own when another bench runs), one project, --workers workers.
2. --names derivation names (`pkg00`, ...), each with a median duration drawn log-uniformly between
   --min-ms and --max-ms; a build's duration is that median times a log-normal factor (sigma --spread),
   drawn once per build (seed --seed). History: --history builds a name, drawn the same way, queued in
   a shuffled order of names in an evaluation of the project (`sim:history`) that the fleet builds
   first (the warm-up, no ETA pass meanwhile): the estimates rest on tries the fleet made itself,
   with what a try carries in production (its worker, the reports' time, the hand-out gap between a
   worker's tries), not on synthetic rows.
3. One `serve` (in-process passes, the in-memory channel layer; the ETA pass of serve itself off:
   this process runs it) and --workers reference workers (the `sim` executor, one build slot each, an
   idle RequestJob every second) in --worker-procs processes; each sim worker builds a derivation for
   the duration drawn for it (the table is handed to the worker processes; the sim executor otherwise
   reads a duration from the store name, which would make every build a name of its own).
4. Once every worker is connected, the warm-up; once it has ended and the fleet has been idle a little
   longer than a hand-out gap can be (decisions.eta.HANDOUT_GAP_MAX_SECS: a new evaluation's queue
   comes to an idle fleet), --builds Queued builds of those names (in a random order, queued a
   microsecond apart) in one Building evaluation; this process runs the ETA pass
   (services.estimates.start_estimate_pass) until every build has been handed out: every --pass-secs
   while a waiting build has no estimate yet, then every --settle-secs (production's default interval,
   GRADIENT_ETA_PASS_INTERVAL_SECS). A pass every 0.5 s throughout, settling over every open estimate
   each time, took a quarter of a core (p50 110-156 ms a run on the 2-core VM) beside the serve process
   whose hand-outs it measured, and slowed them (the fleet's turnover 1.9-2.6 s a build against 1.3 s):
   the estimates were made early in that slowed run's waits, which production's pass does not cause.
5. Each estimate that a hand-out settled: its error |actual - expected| start as a fraction of the
   actual wait from the estimate (handed out - estimated at). Waits shorter than --min-wait seconds are
   left out of the fraction (a build handed out 0.1 s after its estimate said "now" is 100 % off);
   their count is printed.

Printed: the configuration, how many builds were estimated before their hand-out, the fleet's
turnover in the warm-up (what the estimates rest on) and in the measured queue (what the builds met),
as decisions.eta.slot_turnover measures it, the ETA pass's duration and the machine's load average
while the queue ran (the bench shares its cores with whatever else runs: a fleet slowed by other work
after the warm-up makes every estimate early), the absolute error p50/p90 in seconds, the relative
error by basis, and the last line
`eta: start estimate error p50 <x> % p90 <y> % over <n> builds` (the issue's target: p50 <= 25 %).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ROOT,
    describe_machine,
    log_dir,
    percentile,
    reset_tables,
    service_env,
    setup_django,
    wait_for,
)


@dataclass
class EtaConfig:
    builds: int = 2000
    workers: int = 20
    names: int = 40
    history: int = 10
    min_ms: int = 200
    max_ms: int = 2000
    spread: float = 0.3
    min_wait: float = 2.0
    pass_secs: float = 0.5
    settle_secs: float = 10.0
    worker_procs: int = 2
    seed: int = 1
    timeout: float = 1800.0


def _draw(rng: random.Random, median_ms: float, spread: float) -> int:
    return max(1, round(median_ms * math.exp(rng.gauss(0.0, spread))))


def _seed(config: EtaConfig) -> tuple[Any, list[tuple[str, str]], dict[str, int], dict[str, int]]:
    """The project and its workers; returns the project, the workers' credentials, the durations (ms)
    of the warm-up's builds (the history) and those of the measured builds, by drv path (`_queue`
    writes their rows)."""
    from gradient.scheduling.services.projects import project_create
    from gradient.workers.services import worker_register

    reset_tables()
    rng = random.Random(config.seed)
    project = project_create(name="eta")
    credentials = []
    for i in range(config.workers):
        worker, token = worker_register(name=f"eta-{i}", projects=[project])
        credentials.append((str(worker.id), token))
    lo, hi = math.log(config.min_ms), math.log(config.max_ms)
    medians = {f"pkg{k:02d}": math.exp(rng.uniform(lo, hi)) for k in range(config.names)}
    history = []
    for name, median in medians.items():
        for h in range(config.history):
            history.append((f"/nix/store/{'h' * 28}{h:04d}-{name}.drv", _draw(rng, median, config.spread)))
    # Queued in a mixed order of names, as a project's builds come (another generator: the builds'
    # durations below are drawn as before).
    random.Random(config.seed + 1).shuffle(history)
    names = list(medians)
    durations = {}
    for i in range(config.builds):
        name = rng.choice(names)
        durations[f"/nix/store/{i:032d}-{name}.drv"] = _draw(rng, medians[name], config.spread)
    return project, credentials, dict(history), durations


def _queue(project: Any, durations: dict[str, int], repository: str = "sim:eta") -> None:
    from django.db import transaction
    from django.utils import timezone

    from gradient.core.vocab import EvaluationStatus
    from gradient.scheduling.models import DerivationBuild, Evaluation, EvaluationBuild

    now = timezone.now()
    with transaction.atomic():
        evaluation = Evaluation.objects.create(
            project=project, repository=repository, commit="eta", status=EvaluationStatus.BUILDING
        )
        builds = DerivationBuild.objects.bulk_create(
            [
                DerivationBuild(
                    drv_path=path,
                    system="x86_64-linux",
                    status="Queued",
                    queued_at=now + timedelta(microseconds=i),
                    outputs=[{"name": "out", "path": path.removesuffix(".drv")}],
                )
                for i, path in enumerate(durations)
            ]
        )
        EvaluationBuild.objects.bulk_create([EvaluationBuild(evaluation=evaluation, build=b) for b in builds])


def _open_sessions() -> int:
    from gradient.workers.models import WorkerSession

    return WorkerSession.objects.filter(closed_at__isnull=True).count()


def _left() -> int:
    from gradient.core.vocab import BuildStatus
    from gradient.scheduling.models import DerivationBuild

    return DerivationBuild.objects.filter(status=BuildStatus.QUEUED).count()


@dataclass
class _Host:
    process: subprocess.Popen[bytes]
    out: Path


def _start_hosts(config: EtaConfig, credentials: list[tuple[str, str]], url: str, logs: Path) -> list[_Host]:
    workers = [(url, wid, token) for wid, token in credentials]
    procs = max(1, min(config.worker_procs, len(workers)))
    hosts = []
    for p in range(procs):
        spec = logs / f"eta-host-{p}.json"
        out = logs / f"eta-host-{p}.out.json"
        out.unlink(missing_ok=True)
        spec.write_text(
            json.dumps({"workers": workers[p::procs], "slots": 1, "build_ms": 1, "idle_request_secs": 1.0})
        )
        with open(logs / f"eta-host-{p}.log", "wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--host",
                    str(spec),
                    str(out),
                    str(logs / "eta-durations.json"),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        hosts.append(_Host(process, out))
    return hosts


def _stop_hosts(hosts: list[_Host]) -> list[str]:
    for host in hosts:
        if host.process.poll() is None:
            host.process.send_signal(signal.SIGTERM)
    errors = []
    for host in hosts:
        try:
            host.process.wait(60)
        except subprocess.TimeoutExpired:
            host.process.kill()
            host.process.wait(10)
        if host.out.exists():
            errors.extend(json.loads(host.out.read_text()).get("errors", []))
    return errors


def host_main(spec_path: str, out_path: str, durations_path: str) -> None:
    """bench/fleet.py's worker host, the sim executor building each derivation for its drawn time."""
    from gradient.workers.executors import sim

    durations: dict[str, int] = json.loads(Path(durations_path).read_text())
    parse = sim.parse_store_name

    def drawn(drv_path: str) -> tuple[str, int | None, str | None]:
        name, _, fail = parse(drv_path)
        return name, durations.get(drv_path), fail

    sim.parse_store_name = drawn  # type: ignore[assignment]
    import fleet

    fleet.host_main(spec_path, out_path)


@dataclass
class _Run:
    warmup: float = 0.0
    elapsed: float = 0.0
    passes: list[float] = field(default_factory=list)  # each ETA pass's duration (s)
    loads: list[float] = field(default_factory=list)  # the 1-minute load average at each pass


def _turnover(repository: str) -> tuple[float, float, float] | None:
    """How the fleet turned over in one phase (its evaluation's builds), as the estimator measures it
    (decisions.eta.slot_turnover): (a slot's time per build, the tries' mean, the mean hand-out gap)."""
    from gradient.scheduling.decisions import eta
    from gradient.scheduling.models import BuildAttempt

    tries = [
        (worker, begin.timestamp(), end.timestamp())
        for worker, begin, end in BuildAttempt.objects.filter(
            build__evaluation_links__evaluation__repository=repository, finished_at__isnull=False
        ).values_list("worker_id", "started_at", "finished_at")
        if end is not None
    ]
    turnover = eta.slot_turnover(tries, "project")
    if turnover is None:
        return None
    mean = sum(end - begin for _, begin, end in tries) / len(tries)
    return turnover.secs, mean, turnover.secs - mean


def report(config: EtaConfig, run: _Run, errors: list[str]) -> None:
    from gradient.scheduling.models import DerivationBuild, StartEstimate

    settled = list(
        StartEstimate.objects.filter(error_secs__isnull=False).values_list(
            "estimated_at", "expected_start", "started_at", "error_secs", "basis", "position"
        )
    )
    estimated = StartEstimate.objects.count()
    unknown = StartEstimate.objects.filter(expected_start__isnull=True).count()
    fractions: list[float] = []
    by_basis: dict[str, list[float]] = {}
    short = 0
    for at, _, started, error, basis, _ in settled:
        wait = (started - at).total_seconds()
        if wait < config.min_wait:
            short += 1
            continue
        fractions.append(100.0 * error / wait)
        by_basis.setdefault(basis, []).append(100.0 * error / wait)
    absolute = [e for _, _, _, e, _, _ in settled]
    waits = [(s - a).total_seconds() for a, _, s, _, _, _ in settled]
    print(
        f"eta bench: {config.builds} builds of {config.names} derivation names on {config.workers} workers "
        f"(sim, one slot each); medians {config.min_ms}-{config.max_ms} ms log-uniform, spread sigma "
        f"{config.spread}; history {config.history} tries a name built by the fleet first; "
        f"the ETA pass every {config.pass_secs:g} s until all are estimated, then every "
        f"{config.settle_secs:g} s"
    )
    handed = DerivationBuild.objects.filter(status="Completed").count() - config.names * config.history
    print(
        f"  history (the warm-up): {config.names * config.history} builds in {run.warmup:.1f} s; "
        f"builds completed: {handed} in {run.elapsed:.1f} s"
    )
    for phase, repository in (("the warm-up", "sim:history"), ("the measured queue", "sim:eta")):
        if (t := _turnover(repository)) is not None:
            print(
                f"  the fleet's turnover in {phase}: {t[0]:.2f} s a build a slot (tries {t[1]:.2f} s, "
                f"hand-out gap {t[2]:.2f} s)"
            )
    if run.passes:
        print(
            f"  ETA pass: {len(run.passes)} runs, p50 {1000 * percentile(run.passes, 50):.0f} ms, "
            f"max {1000 * max(run.passes):.0f} ms; load average (1 min) during the queue "
            f"{min(run.loads):.2f} to {max(run.loads):.2f}"
        )
    print(
        f"  estimated while waiting: {estimated} ({unknown} without a basis); settled by a hand-out: "
        f"{len(settled)}; waits shorter than {config.min_wait:g} s left out of the fraction: {short}"
    )
    if waits:
        print(
            f"  actual wait from the estimate: p50 {percentile(waits, 50):.1f} s, "
            f"p90 {percentile(waits, 90):.1f} s, max {max(waits):.1f} s"
        )
    if absolute:
        print(
            f"  |actual - expected| start: p50 {percentile(absolute, 50):.2f} s, "
            f"p90 {percentile(absolute, 90):.2f} s"
        )
    for basis, values in sorted(by_basis.items()):
        print(
            f"  basis {basis}: p50 {percentile(values, 50):.1f} %, p90 {percentile(values, 90):.1f} % "
            f"over {len(values)}"
        )
    for error in errors[:5]:
        print(f"  error: {error}")
    p50 = percentile(fractions, 50) if fractions else float("nan")
    p90 = percentile(fractions, 90) if fractions else float("nan")
    print(f"eta: start estimate error p50 {p50:.1f} % p90 {p90:.1f} % over {len(fractions)} builds")


def run(config: EtaConfig, database_url: str) -> None:
    from django.db import close_old_connections
    from django.utils import timezone

    from gradient.scheduling.decisions.eta import HANDOUT_GAP_MAX_SECS
    from gradient.scheduling.services.estimates import start_estimate_pass
    from tests.support.processes import serve

    project, credentials, history, durations = _seed(config)
    logs = log_dir()
    (logs / "eta-durations.json").write_text(json.dumps({**history, **durations}))
    env = service_env(database_url, None, GRADIENT_ETA_PASS_INTERVAL_SECS="0")
    errors: list[str] = []
    run = _Run()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(serve(env, logs, extra_args=["--log-level", "warning"]))
        hosts = _start_hosts(config, credentials, server.ws_url, logs)
        try:
            wait_for(lambda: _open_sessions() >= config.workers, timeout=120, what="worker sessions")
            # The warm-up: the fleet builds the history the estimates rest on (no pass runs meanwhile).
            warm = time.monotonic()
            _queue(project, history, repository="sim:history")
            wait_for(lambda: _left() == 0 and _running() == 0, timeout=config.timeout, what="the warm-up")
            run.warmup = time.monotonic() - warm
            # The measured queue comes to an idle fleet, as a new evaluation's builds do: past the gap
            # the estimator takes for a hand-out (decisions.eta.HANDOUT_GAP_MAX_SECS), not for idleness.
            time.sleep(HANDOUT_GAP_MAX_SECS + 1.0)
            _queue(project, durations)
            started = time.monotonic()
            last = -math.inf
            while _left() > 0:
                if time.monotonic() - started > config.timeout:
                    errors.append(f"not finished within {config.timeout:.0f} s")
                    break
                tick = time.monotonic()
                # Every --pass-secs while a waiting build is not estimated yet; once all are, every
                # --settle-secs (the settling is exact whenever it runs: the first hand-out's time).
                if tick - last >= config.settle_secs or _unestimated():
                    start_estimate_pass(now=timezone.now())
                    close_old_connections()
                    last = time.monotonic()
                    run.passes.append(last - tick)
                run.loads.append(os.getloadavg()[0])
                time.sleep(max(0.0, config.pass_secs - (time.monotonic() - tick)))
            # The last ones handed out: settled by one more pass once their claims are in.
            time.sleep(1.0)
            start_estimate_pass(now=timezone.now())
            run.elapsed = time.monotonic() - started
            wait_for(lambda: _running() == 0, timeout=120, what="the last builds")
        finally:
            errors.extend(_stop_hosts(hosts))
    report(config, run, errors)


def _unestimated() -> bool:
    """Whether a Queued build waits without an estimate of its current wait (the pass's own test)."""
    from django.db.models import Exists, OuterRef

    from gradient.core.vocab import BuildStatus
    from gradient.scheduling.models import DerivationBuild, StartEstimate

    estimated = StartEstimate.objects.filter(build_id=OuterRef("pk"), waiting_since=OuterRef("queued_at"))
    return DerivationBuild.objects.filter(status=BuildStatus.QUEUED).exclude(Exists(estimated)).exists()


def _running() -> int:
    from gradient.core.vocab import BuildStatus
    from gradient.scheduling.models import DerivationBuild

    return DerivationBuild.objects.filter(status=BuildStatus.BUILDING).count()


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--host":
        host_main(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = EtaConfig()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    config = EtaConfig(**vars(args))
    if min(config.builds, config.workers, config.names, config.history) < 1:
        parser.error("--builds, --workers, --names and --history must be >= 1")
    url = setup_django()
    print(f"machine: {describe_machine()}")
    print(f"database: {url}")
    run(config, url)


if __name__ == "__main__":
    main()
