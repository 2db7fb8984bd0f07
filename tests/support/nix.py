"""Nix for tests: skip when it is missing, an offline configuration, and example flakes as fresh git
repositories (a flake at a local path must be one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from gradient.workers.executors.nix_parse import OFFLINE_NIX_CONFIG
from tests.support.processes import ROOT

EXAMPLES = ROOT / "examples" / "flakes"
SKIP_REASON = "needs Nix (`nix` and `nix-store` on PATH; .ci/run installs Debian's nix-bin)"


def nix_available() -> bool:
    return shutil.which("nix") is not None and shutil.which("nix-store") is not None


requires_nix = pytest.mark.skipif(not nix_available(), reason=SKIP_REASON)


def nix_config(*extra: str) -> str:
    """A local store, no sandbox, no build users, no network (plus `extra` lines)."""
    return "\n".join([OFFLINE_NIX_CONFIG, *extra]) + "\n"


def nix_environ(*extra: str) -> dict[str, str]:
    return {**os.environ, "NIX_CONFIG": nix_config(*extra)}


def git_commit_all(directory: Path, message: str = "example") -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=Gradient tests", "-c", "user.email=tests@gradient.invalid", *args],
            cwd=directory,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    if not (directory / ".git").exists():
        git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "--allow-empty", "-m", message)
    return git("rev-parse", "HEAD")


def example_flake(name: str, parent: Path, *, salt: str | None = None) -> tuple[Path, str]:
    """A copy of examples/flakes/<name> under `parent` with a fresh `salt` (so its derivations are new
    to the store), committed to a new git repository. Returns (directory, commit)."""
    directory = parent / name
    shutil.copytree(EXAMPLES / name, directory)
    (directory / "salt").write_text(salt or uuid.uuid4().hex)
    return directory, git_commit_all(directory, name)


def write_flake(directory: Path, flake_nix: str) -> tuple[Path, str]:
    """A one-off flake (its flake.nix given) committed to a new git repository."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "flake.nix").write_text(flake_nix)
    return directory, git_commit_all(directory)
