"""Executors: what a worker runs its jobs with (`sim`, a simulated Nix; `nix`, the real one)."""

from __future__ import annotations

from collections.abc import Iterable

from gradient.workers.executors.base import Executor, ExecutorFailure, ExecutorUnavailable
from gradient.workers.executors.sim import SimExecutor

EXECUTORS = ("sim", "nix")


def make_executor(name: str, *, sim_store: Iterable[str] = (), sim_build_ms: int = 100) -> Executor:
    """The named executor; ExecutorUnavailable when it cannot run here (the `nix` executor asks the
    local Nix for its settings first, so a missing or broken Nix is said at start)."""
    if name == "sim":
        return SimExecutor(store=sim_store, build_ms=sim_build_ms)
    if name == "nix":
        from gradient.workers.executors.nix import NixExecutor

        return NixExecutor.detect()
    raise ExecutorUnavailable(f"unknown executor {name!r}: choose one of {', '.join(EXECUTORS)}")


__all__ = ["EXECUTORS", "Executor", "ExecutorFailure", "ExecutorUnavailable", "SimExecutor", "make_executor"]
