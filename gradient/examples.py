"""The example flakes under examples/flakes (`/bin/sh` builders, no nixpkgs): where they are, and a
fresh git repository of one, since a flake at a local path is read from git (or as a `path:`).

`manage.py demo --executor nix` and the nix tests submit these copies.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

EXAMPLE_FLAKES = Path(__file__).resolve().parent.parent / "examples" / "flakes"
# The examples and the wildcards that select their derivations (empty: the worker's defaults,
# packages.<system>.* and checks.<system>.*).
EXAMPLES: dict[str, list[str]] = {
    "chain": [],
    "diamond": [],
    "failing": [],
    "check": [],
    "multi-system": ["packages.*.*"],
}


def git_commit_all(directory: Path, message: str = "example") -> str:
    """Commit everything in `directory` (a new repository if it is none yet); returns the commit."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=Gradient", "-c", "user.email=gradient@example.invalid", *args],
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


def example_repository(name: str, parent: Path, *, salt: str | None = None) -> tuple[Path, str]:
    """A copy of examples/flakes/<name> under `parent`, with a `salt` file (a fresh one by default)
    so its derivations are new to the store, committed to a new git repository: (directory, commit)."""
    if name not in EXAMPLES:
        raise ValueError(f"no example flake {name!r}: choose one of {', '.join(EXAMPLES)}")
    directory = parent / name
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(EXAMPLE_FLAKES / name, directory)
    (directory / "salt").write_text(salt or uuid.uuid4().hex)
    return directory, git_commit_all(directory, name)
