"""Nix for tests: skip when it is missing, an offline configuration, and one-off flakes as fresh git
repositories (a flake at a local path must be one; the examples: gradient.examples)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gradient.examples import git_commit_all
from gradient.workers.executors.nix_parse import OFFLINE_NIX_CONFIG

SKIP_REASON = "needs Nix (`nix` and `nix-store` on PATH; .ci/run installs Debian's nix-bin)"


def nix_available() -> bool:
    return shutil.which("nix") is not None and shutil.which("nix-store") is not None


requires_nix = pytest.mark.skipif(not nix_available(), reason=SKIP_REASON)


def nix_config(*extra: str) -> str:
    """A local store, no sandbox, no build users, no network (plus `extra` lines)."""
    return "\n".join([OFFLINE_NIX_CONFIG, *extra]) + "\n"


def nix_environ(*extra: str) -> dict[str, str]:
    return {**os.environ, "NIX_CONFIG": nix_config(*extra)}


def write_flake(directory: Path, flake_nix: str) -> tuple[Path, str]:
    """A one-off flake (its flake.nix given) committed to a new git repository."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "flake.nix").write_text(flake_nix)
    return directory, git_commit_all(directory)
