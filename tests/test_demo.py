"""`manage.py demo --executor nix` and the example flakes it submits (gradient.examples): fresh git
repositories of examples/flakes, the workers' Nix configuration, and a clear stop without Nix."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.utils import timezone

from gradient.examples import EXAMPLE_FLAKES, EXAMPLES, example_repository
from gradient.management.commands import demo
from gradient.management.commands.demo import Command, demo_nix_config
from gradient.workers.models import Worker
from gradient.workers.services import worker_deactivate, worker_register
from tests.factories import ProjectFactory


def test_every_example_flake_is_listed_with_its_wildcards() -> None:
    assert sorted(EXAMPLES) == sorted(p.name for p in EXAMPLE_FLAKES.iterdir() if (p / "flake.nix").exists())
    assert EXAMPLES["multi-system"] == ["packages.*.*"]


def test_the_nix_samples_are_fresh_commits_of_every_example(tmp_path: Path) -> None:
    first = Command._samples("nix", tmp_path)
    assert [Path(url).name for url, _, _ in first] == list(EXAMPLES)
    for url, commit, wildcards in first:
        directory = Path(url)
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert head == commit and wildcards == EXAMPLES[directory.name]
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=directory, capture_output=True, text=True, check=True
        ).stdout.split()
        assert "flake.nix" in tracked and "salt" in tracked
    # Run again (the store may hold the first run's outputs): new salts, new commits.
    second = Command._samples("nix", tmp_path)
    assert all(a[1] != b[1] for a, b in zip(first, second, strict=True))
    assert Command._samples("sim", tmp_path)[0] == ("sim:diamond?duration_ms=3000", "demo", [])


def test_an_unknown_example_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="choose one of chain"):
        example_repository("nixpkgs", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_demo_workers_nix_config_follows_the_operators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIX_CONFIG", "cores = 2\n")
    config = demo_nix_config("extra-platforms = aarch64-linux")
    lines = config.splitlines()
    assert lines[0] == "cores = 2" and lines[-1] == "extra-platforms = aarch64-linux"
    assert {"sandbox = false", "build-users-group =", "substituters ="} <= set(lines)


@pytest.mark.django_db
def test_the_nix_demo_without_nix_says_how_to_get_it_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(CommandError, match="apt-get install nix-bin"):
        call_command("demo", "--executor", "nix", "--port", "1")
    assert not User.objects.exists() and not Worker.objects.exists()


class FakeProcess:
    """A stand-in for a demo child: the server or a worker, alive until told otherwise."""

    started: list[FakeProcess] = []

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str], stdout: Any, stderr: Any) -> None:
        self.argv, self.env, self.log = argv, env, Path(stdout.name)
        stdout.close()
        self.code: int | None = None
        FakeProcess.started.append(self)

    @property
    def name(self) -> str:
        return "serve" if "serve" in self.argv else self.log.stem

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.code = -sig

    def wait(self, timeout: float | None = None) -> int | None:
        return self.code

    def kill(self) -> None:
        self.code = -9


@pytest.mark.django_db
def test_a_deactivated_worker_stops_alone_the_demo_says_which_and_why_and_starts_it_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, settings: Any
) -> None:
    """Deactivating demo-b in the console ends its process (403): the demo keeps the server and the other
    workers running, names the worker and the server's refusal, and starts it again until it stays up.
    No worker token is on a command line (`ps` shows those to every user); it is in the environment."""
    (tmp_path / "var").mkdir()
    settings.BASE_DIR = tmp_path
    FakeProcess.started = []
    clock = {"now": 0.0, "ticks": 0}
    monkeypatch.setattr(demo.subprocess, "Popen", FakeProcess)
    monkeypatch.setattr(Command, "_wait_for", staticmethod(lambda url, timeout=60.0: None))
    monkeypatch.setattr(demo.time, "monotonic", lambda: clock["now"])

    def by_name(name: str) -> list[FakeProcess]:
        return [p for p in FakeProcess.started if p.name == name]

    def tick(_: float) -> None:
        clock["ticks"] += 1
        clock["now"] += 3.0
        if clock["ticks"] == 2:  # the operator deactivates demo-b: the worker logs the refusal, exits 3
            [b] = by_name("demo-b")
            b.log.write_text(
                "2026-12-01 23:00:00,000 ERROR gradient.workers.client.worker: the server refused this "
                "worker (403): worker deactivated\n"
            )
            b.code = 3
        if clock["ticks"] == 12:
            by_name("serve")[0].code = 0

    monkeypatch.setattr(demo.time, "sleep", tick)
    out, err = io.StringIO(), io.StringIO()
    call_command("demo", "--port", "1", stdout=out, stderr=err)

    said = err.getvalue()
    assert "worker demo-b stopped (exit 3)" in said
    assert "the server refused it" in said and "worker deactivated" in said
    assert said.count("demo-b stopped") == 1  # retried quietly, said once
    assert "worker demo-b is running again" in said
    assert "the server stopped (exit 0)" in said
    assert len(by_name("demo-b")) == 2  # started again, 10 s later
    assert len(by_name("demo-a")) == len(by_name("demo-c")) == len(by_name("serve")) == 1
    workers = [p for p in FakeProcess.started if p.name != "serve"]
    for process in workers:
        token = process.env["GRADIENT_WORKER_TOKEN"]
        assert token and token not in " ".join(process.argv) and "--token" not in process.argv


@pytest.mark.django_db
def test_the_demo_activates_its_own_workers_that_an_earlier_run_left_deactivated(tmp_path: Path) -> None:
    project = ProjectFactory(name="demo")
    worker, _ = worker_register(name="demo-b", projects=[project])
    worker_deactivate(worker_id=worker.id, now=timezone.now())
    out = io.StringIO()
    command = Command(stdout=out)
    names = [name for _, _, _, name in command._prepare_workers(project)]
    assert names == ["demo-a", "demo-b", "demo-c"]
    assert Worker.objects.get(name="demo-b").active
    assert "demo-b was deactivated" in out.getvalue()


# --- SIGTERM and the trickle (issue 34, item 8) -------------------------------------------------------


def test_trickle_samples_finish_and_each_has_its_own_salt() -> None:
    names = [demo.trickle_sample(n) for n in range(1, 5)]
    assert names[0] == f"{demo.SAMPLES[0]}&salt=trickle-1" and len(set(names)) == 4
    assert all("fail=" not in n and "aarch64" not in n for n in names)


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_the_demo_keeps_a_trickle_of_work_and_sigterm_stops_it_with_its_server_and_workers(
    tmp_path: Path,
) -> None:
    import os
    import signal
    import sys
    import time

    import psutil

    from gradient.scheduling.models import Evaluation
    from tests.support.processes import ROOT, database_env, free_port

    log = open(tmp_path / "demo.log", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        [sys.executable, "manage.py", "demo", "--port", str(free_port()), "--trickle-secs", "1"],
        cwd=ROOT,
        env=database_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        # The five samples, then more: the trickle goes on after the samples are in.
        while Evaluation.objects.filter(repository__contains="salt=trickle-").count() < 2:
            assert process.poll() is None, (tmp_path / "demo.log").read_text()
            assert time.monotonic() < deadline, "no trickled evaluation in 120 s"
            time.sleep(0.5)
        children = psutil.Process(process.pid).children()
        assert len(children) == 4, "the server and three workers"

        os.kill(process.pid, signal.SIGTERM)

        process.wait(60)  # raises when the demo itself did not stop
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert alive == [], f"left running after SIGTERM: {[c.pid for c in alive]}"
    finally:
        log.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        for child in children:
            if child.is_running():
                child.kill()
