"""Executors: what a worker runs its jobs with (`sim` now; `nix` arrives in a later issue)."""

from __future__ import annotations

from collections.abc import Iterable

from gradient.workers.executors.base import Executor, ExecutorFailure
from gradient.workers.executors.sim import SimExecutor

EXECUTORS = ("sim", "nix")


class ExecutorUnavailable(RuntimeError):
    pass


def make_executor(name: str, *, sim_store: Iterable[str] = (), sim_build_ms: int = 100) -> Executor:
    if name == "sim":
        return SimExecutor(store=sim_store, build_ms=sim_build_ms)
    if name == "nix":
        raise ExecutorUnavailable(
            "the nix executor is not part of this release yet; run with --executor sim for a simulated Nix"
        )
    raise ExecutorUnavailable(f"unknown executor {name!r}: choose one of {', '.join(EXECUTORS)}")


__all__ = ["EXECUTORS", "Executor", "ExecutorFailure", "ExecutorUnavailable", "SimExecutor", "make_executor"]
