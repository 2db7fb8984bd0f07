"""What a worker's executor does for a job: fetch a flake, evaluate it, build derivations, abort.

The reference worker (gradient.workers.client) owns the protocol: it sends the JobUpdates, reports
and cluster signals, enforces timeouts and cancels tasks. An executor only does the work, through
this interface, so a simulated Nix (`sim`) and the real one (`nix`) are interchangeable. A failure
is an ExecutorFailure carrying the protocol's BuildFailureKind.
"""

from __future__ import annotations

import platform
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from gradient.core.protocol import (
    BuildFailureKind,
    BuildProgress,
    BuildSpec,
    BuiltOutput,
    ClusterAddress,
    ClusterMembership,
    ClusterPeer,
    ClusterSignalDelivery,
    DiscoveredDerivation,
    EvalProgress,
    FlakeSource,
)


class ExecutorUnavailable(RuntimeError):
    """The executor cannot run on this machine (unknown name, Nix missing or broken)."""


class ExecutorFailure(Exception):
    """The job failed in a way the worker reports as JobFailed{kind, error, missing_paths}."""

    def __init__(self, kind: BuildFailureKind, error: str, missing_paths: list[str] | None = None) -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error
        self.missing_paths = missing_paths


@dataclass
class FlakeEvaluation:
    """EvaluateFlake: the attributes the wildcards selected."""

    attrs: list[str]
    warnings: list[str] = field(default_factory=list)


@dataclass
class DerivationEvaluation:
    """EvaluateDerivations: every derivation the selected attributes need, dependencies first."""

    derivations: list[DiscoveredDerivation]
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Derivations the server said it knows, left out of `derivations` with their closures.
    known_drvs: list[str] = field(default_factory=list)


@dataclass
class BuildResult:
    outputs: list[BuiltOutput]
    substituted: bool = False


class JobContext(ABC):
    """The running job as an executor sees it: its ids, its cluster seat, and the two ways to talk back
    (progress reports, and signals to the other members of its cluster attempt)."""

    job_id: str
    assignment_id: str
    cluster: ClusterMembership | None
    roster: list[ClusterPeer]

    @abstractmethod
    async def progress(self, message: BuildProgress | EvalProgress) -> None: ...

    def build_log(self, build_id: str, text: str) -> None:  # noqa: B027 (a no-op is a valid default)
        """What the builder of `build_id` printed (stdout and stderr, as text), as it prints it: the
        worker streams it to the server as BuildLog pieces. Never blocks."""

    async def known_derivations(self, drv_paths: Sequence[str]) -> set[str]:
        """Those of `drv_paths` the server knows with their whole closure (QueryKnownDerivations): an
        executor asks before walking a top-level derivation's closure and names the known ones in
        `known_drvs` instead. None known by default (and with --no-known-query)."""
        return set()

    @abstractmethod
    async def send_signal(self, payload: str, to: ClusterAddress | None = None) -> None:
        """A ClusterSignal to one member (`to`) or to every other member of the attempt."""

    @abstractmethod
    async def receive_signal(self, wait_secs: float) -> ClusterSignalDelivery | None:
        """The next ClusterSignal from another member, or None after `wait_secs` seconds."""


def host_system() -> str:
    """The Nix system of this host (macOS reported as darwin)."""
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv7l": "armv7l", "i386": "i686"}.get(
        machine, machine
    )
    return f"{arch}-{platform.system().lower()}"


class Executor(ABC):
    """The work of a worker. Methods raise ExecutorFailure on failure; a cancelled task means the job
    was aborted (AbortJob, AbortCluster, or the worker stopping) and `abort` is called after."""

    name: str = "abstract"

    def default_architectures(self) -> list[str]:
        return [host_system()]

    def default_system_features(self) -> list[str]:
        return []

    def build_peak_ram_mb(self) -> int | None:
        """Peak RAM of recent builds, for the heartbeat; None when unknown."""
        return None

    @abstractmethod
    async def present_paths(self, paths: Sequence[str]) -> set[str]:
        """Which of these store paths are valid in the local store (for scoring offers)."""

    @abstractmethod
    async def fetch(self, source: FlakeSource, ctx: JobContext) -> str:
        """FetchFlake: the store path of the fetched source."""

    @abstractmethod
    async def evaluate_flake(self, flake: str, wildcards: list[str], ctx: JobContext) -> FlakeEvaluation:
        """EvaluateFlake on a flake reference (a store path, or the repository URL)."""

    @abstractmethod
    async def evaluate_derivations(
        self, flake: str, attrs: list[str], ctx: JobContext
    ) -> DerivationEvaluation:
        """EvaluateDerivations: the derivations of the selected attributes and their closure."""

    @abstractmethod
    async def build(self, spec: BuildSpec, ctx: JobContext) -> BuildResult:
        """Realise one derivation."""

    async def abort(self, ctx: JobContext) -> None:  # noqa: B027 (a no-op is a valid default)
        """Clean up after a cancelled job (kill builders, ...)."""
