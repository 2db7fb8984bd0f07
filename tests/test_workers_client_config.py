"""The reference worker's settings: flags over GRADIENT_WORKER_* variables over defaults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gradient.workers.client.config import ConfigError, parse_config

BASE = ["--server", "ws://h/proto", "--worker-id", "w", "--token", "t"]


def test_defaults_are_the_designs() -> None:
    config = parse_config(BASE, {})
    assert (config.max_concurrent_builds, config.max_concurrent_evals) == (1, 1)
    assert (config.heartbeat_secs, config.idle_request_secs, config.stop_grace_secs) == (10.0, 10.0, 5.0)
    assert (config.fetch, config.eval, config.build) == (True, True, True)
    assert config.architectures is None and config.system_features is None  # detected
    assert config.executor == "nix" and config.zone is None and config.job_kinds == ["flake", "build"]


def test_variables_configure_everything_and_flags_win() -> None:
    env = {
        "GRADIENT_WORKER_SERVER": "ws://env/proto",
        "GRADIENT_WORKER_ID": "id-env",
        "GRADIENT_WORKER_TOKEN": "tok-env",
        "GRADIENT_WORKER_EXECUTOR": "sim",
        "GRADIENT_WORKER_SYSTEM_ARCHITECTURES": "x86_64-linux i686-linux",
        "GRADIENT_WORKER_SYSTEM_FEATURES": "",
        "GRADIENT_WORKER_BUILD_MAX_CONCURRENT": "4",
        "GRADIENT_WORKER_ZONE": "eu",
        "GRADIENT_WORKER_ENDPOINT": "10.0.0.2:9000",
        "GRADIENT_WORKER_SYSTEM_CPU_CORE_SCORE": "1234",
        "GRADIENT_WORKER_HEARTBEAT_SECS": "0.5",
    }
    config = parse_config([], env)
    assert (config.server, config.worker_id, config.token, config.executor) == (
        "ws://env/proto",
        "id-env",
        "tok-env",
        "sim",
    )
    assert config.architectures == ["x86_64-linux", "i686-linux"] and config.system_features == []
    assert (config.max_concurrent_builds, config.zone, config.endpoint) == (4, "eu", "10.0.0.2:9000")
    assert config.cpu_core_score == 1234 and config.heartbeat_secs == 0.5

    flagged = parse_config(
        ["--slots", "2", "--arch", "aarch64-linux", "--arch", "armv7l-linux,riscv64-linux"], env
    )
    assert flagged.max_concurrent_builds == 2
    assert flagged.architectures == ["aarch64-linux", "armv7l-linux", "riscv64-linux"]


def test_an_eval_only_worker_neither_fetches_nor_builds() -> None:
    config = parse_config([*BASE, "--eval-only"], {})
    assert (config.fetch, config.eval, config.build) == (False, True, False)
    assert config.job_kinds == ["flake"]
    assert parse_config(BASE, {"GRADIENT_WORKER_EVAL_ONLY": "true"}).build is False
    assert parse_config([*BASE, "--capabilities", "build"], {}).job_kinds == ["build"]


def test_the_token_can_come_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("secret\n")
    config = parse_config(
        ["--server", "ws://h/proto", "--worker-id", "w", "--token-file", str(tmp_path / "token")], {}
    )
    assert config.token == "secret"


@pytest.mark.parametrize(
    "argv",
    [
        ["--worker-id", "w", "--token", "t"],
        [*BASE, "--capabilities", "fetch,teleport"],
        [*BASE, "--slots", "-1"],
        ["--server", "ws://h/proto", "--worker-id", "w", "--token-file", "/no/such/file"],
    ],
)
def test_missing_or_bad_settings_are_a_config_error(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_config(argv, {})


def test_the_token_leaves_the_workers_environment_once_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradient.workers.client.__main__ import main
    from gradient.workers.client.worker import EXIT_CONFIG

    monkeypatch.setenv("GRADIENT_WORKER_TOKEN", "the-token")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nix: main stops after reading its configuration
    assert (
        main(["--server", "ws://127.0.0.1:9/proto", "--worker-id", "w1", "--executor", "nix"]) == EXIT_CONFIG
    )
    assert "GRADIENT_WORKER_TOKEN" not in os.environ


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="Linux's /proc")
def test_a_running_worker_shows_its_token_to_no_other_process_of_its_user(tmp_path: Path) -> None:
    """Taken out of os.environ, the token reaches no child; but Linux keeps the environment a process
    started with in /proc/<pid>/environ, which every process of the same user reads, a builder that runs
    without Nix's sandbox too (issue 36, finding 1): the worker blanks the token there as well."""
    import subprocess
    import sys
    import time
    import uuid

    from tests.support.processes import ROOT, base_env

    token = f"tok-{uuid.uuid4().hex}"
    log = tmp_path / "worker.log"
    argv = ["--server", "ws://127.0.0.1:9/proto", "--worker-id", "w1", "--executor", "sim"]
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "gradient.workers.client", *argv],
            cwd=ROOT,
            env=base_env(GRADIENT_WORKER_TOKEN=token),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "reconnecting in" not in log.read_text() and time.monotonic() < deadline:
            assert worker.poll() is None, log.read_text()
            time.sleep(0.1)
        assert "reconnecting in" in log.read_text(), log.read_text()  # configured, and trying to connect
        environ = Path(f"/proc/{worker.pid}/environ").read_bytes()
    finally:
        worker.terminate()
        worker.wait(30)
    assert token.encode() not in environ
    assert b"GRADIENT_PRESENCE_FLUSH_SECS=0.25" in environ  # the rest of it is still there


def test_a_token_on_the_command_line_is_taken_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from gradient.workers.client.__main__ import main
    from gradient.workers.client.worker import EXIT_CONFIG

    monkeypatch.setenv("PATH", "/nonexistent")  # no nix: main stops after reading its configuration
    argv = ["--server", "ws://127.0.0.1:9/proto", "--worker-id", "w1", "--executor", "nix"]
    for token in (["--token", "t"], ["--token=t"]):
        caplog.clear()
        assert main([*argv, *token]) == EXIT_CONFIG
        assert any("every user of this host can read" in r.getMessage() for r in caplog.records), token
    monkeypatch.setenv("GRADIENT_WORKER_TOKEN", "t")
    caplog.clear()
    assert main(argv) == EXIT_CONFIG
    assert not any("every user of this host" in r.getMessage() for r in caplog.records)
