"""`manage.py demo --executor nix` and the example flakes it submits (gradient.examples): fresh git
repositories of examples/flakes, the workers' Nix configuration, and a clear stop without Nix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command

from gradient.examples import EXAMPLE_FLAKES, EXAMPLES, example_repository
from gradient.management.commands.demo import Command, demo_nix_config
from gradient.workers.models import Worker


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
