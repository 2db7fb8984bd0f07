"""Scoring pending jobs for one RequestJob: the reference notes' rules, as pure functions.

Score = sum of the rules' contributions; the highest wins, ties go to the smaller job id, nothing below
the floor of 0 is handed out, and a rule may veto. The breakdown is kept on the assignment row so an
operator can read why a job went where it went. Two policies: `resource-aware` (the default) and
`simple` (no ResourceSaturation); an unknown policy name falls back to the default.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

RESOURCE_AWARE = "resource-aware"
SIMPLE = "simple"
POLICIES = (RESOURCE_AWARE, SIMPLE)

ASSIGNMENT_FLOOR = 0.0
WAIT_CAP = 4000.0
DEFAULT_MEAN_WAIT_SECS = 60.0
ESTIMATE_CAP_SECS = 3600.0
QOS_BONUS = 5000.0
RESCORE_WAIT_PASSES = 4
RESERVE_FETCH_PENALTY = 300.0
TRANSFER_PENALTY = 4000.0
LARGE_TRANSFER_BYTES = 1 << 30  # 1 GiB
TRANSFER_SLOTS = 2
SATURATION_PENALTY = 8600.0
CPU_SATURATED_PCT = 80.0
RAM_FREE_LOW_FRACTION = 0.10
DEFAULT_DOWNLOAD_MBPS = 100.0
# Metrics travel with the 10 s heartbeat; older than six of them they are unknown to scoring, so a
# worker whose metrics stopped coming is not held back by a load it reported long ago.
METRICS_STALE_SECS = 60.0
REFERENCE_CPU_CORE_SCORE = 1000.0

CandidateKind = Literal["eval", "build"]
"""A candidate's JobKind value (not the protocol's JobKindName, which calls an evaluation `flake`)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A pending job as one worker would get it."""

    job_id: str
    kind: CandidateKind
    waited_secs: float
    prioritized: bool = False
    has_fetch_step: bool = False
    # The worker's own RequestJobChunk answer for this job; None when it has not scored it (yet).
    missing_nar_size: int | None = None
    missing_count: int | None = None
    # How many assignment passes ago this job was offered to the worker; None if never offered.
    offered_passes_ago: int | None = None
    # Mean duration of earlier builds of this derivation (seconds), if any.
    history_secs: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What scoring knows about the requesting worker; None is "unknown" (no metrics yet)."""

    can_fetch: bool = False
    cpu_core_score: int | None = None
    cpu_usage_pct: float | None = None
    ram_free_mb: int | None = None
    ram_total_mb: int | None = None
    build_peak_ram_mb: int | None = None
    download_speed_mbps: float | None = None
    large_transfers_running: int = 0


@dataclass(frozen=True, slots=True)
class PoolView:
    mean_wait_secs: float | None = None  # mean wait of jobs handed out in the last hour
    fetch_workers_idle: int = 0
    fetch_workers_total: int = 0


@dataclass(frozen=True, slots=True)
class Score:
    job_id: str
    total: float
    breakdown: dict[str, float] = field(default_factory=dict)
    vetoed_by: str | None = None

    @property
    def eligible(self) -> bool:
        return self.vetoed_by is None and self.total >= ASSIGNMENT_FLOOR


def policy_name(name: str) -> str:
    return name if name in POLICIES else RESOURCE_AWARE


def mean_wait_secs(pool: PoolView) -> float:
    """The mean wait WaitTime divides by (the pool's, or a default before there is one)."""
    return _mean_wait(pool)


def download_mbps(w: WorkerView) -> float:
    """The download speed EstimatedTime assumes for the worker (its own, or a default)."""
    return (
        w.download_speed_mbps
        if w.download_speed_mbps and w.download_speed_mbps > 0
        else DEFAULT_DOWNLOAD_MBPS
    )


def _mean_wait(pool: PoolView) -> float:
    return pool.mean_wait_secs if pool.mean_wait_secs and pool.mean_wait_secs > 0 else DEFAULT_MEAN_WAIT_SECS


def wait_time(c: Candidate, pool: PoolView) -> float:
    return min(WAIT_CAP, 60.0 * max(0.0, c.waited_secs) / _mean_wait(pool))


def wait_cap_secs(pool: PoolView) -> float:
    """The wait from which WaitTime is capped: past it, every job's WaitTime is the same."""
    return WAIT_CAP * _mean_wait(pool) / 60.0


def estimate_secs(c: Candidate, w: WorkerView) -> float:
    """Transfer of the missing NAR bytes at the worker's download speed, plus the build's history
    scaled by the worker's single-core speed."""
    transfer = (c.missing_nar_size or 0) / (download_mbps(w) * 125_000.0)
    build = 0.0
    if c.history_secs is not None:
        speed = (w.cpu_core_score or REFERENCE_CPU_CORE_SCORE) / REFERENCE_CPU_CORE_SCORE
        build = c.history_secs / max(speed, 0.01)
    return transfer + build


def estimated_time(c: Candidate, w: WorkerView) -> float:
    return ESTIMATE_CAP_SECS - min(estimate_secs(c, w), ESTIMATE_CAP_SECS)


def qos(c: Candidate) -> float:
    return QOS_BONUS if c.prioritized else 0.0


def rescore_wait_vetoes(c: Candidate) -> bool:
    """Veto a build offered to this worker whose score is not in yet, for up to 4 passes."""
    return (
        c.kind == "build"
        and c.missing_nar_size is None
        and c.offered_passes_ago is not None
        and c.offered_passes_ago < RESCORE_WAIT_PASSES
    )


def reserve_fetch_workers(c: Candidate, w: WorkerView, pool: PoolView) -> float:
    if not w.can_fetch or c.has_fetch_step or pool.fetch_workers_total <= 0:
        return 0.0
    idle = min(pool.fetch_workers_idle, pool.fetch_workers_total)
    return -RESERVE_FETCH_PENALTY * (1.0 - idle / pool.fetch_workers_total)


def transfer_limit(c: Candidate, w: WorkerView) -> float:
    large = (c.missing_nar_size or 0) >= LARGE_TRANSFER_BYTES
    return -TRANSFER_PENALTY if large and w.large_transfers_running >= TRANSFER_SLOTS else 0.0


def metrics_stale(metrics_at: datetime | None, now: datetime) -> bool:
    """Whether metrics received at `metrics_at` are too old to be scored: they count as unknown. (A
    session's metrics always come with their time; a row without one has no age to judge.)"""
    return metrics_at is not None and (now - metrics_at).total_seconds() > METRICS_STALE_SECS


CPU_SIGNAL = f"CPU > {CPU_SATURATED_PCT:.0f} %"
RAM_SIGNAL = f"free RAM < {RAM_FREE_LOW_FRACTION * 100:.0f} %"
PEAK_RAM_SIGNAL = "free RAM below their builds' peak"


def saturation_signals(w: WorkerView) -> tuple[str, ...]:
    """The ResourceSaturation signals the worker's metrics show, in words ("CPU > 80 %")."""
    signals: list[str] = []
    if w.cpu_usage_pct is not None and w.cpu_usage_pct > CPU_SATURATED_PCT:
        signals.append(CPU_SIGNAL)
    if (
        w.ram_free_mb is not None
        and w.ram_total_mb
        and w.ram_free_mb < RAM_FREE_LOW_FRACTION * w.ram_total_mb
    ):
        signals.append(RAM_SIGNAL)
    if w.build_peak_ram_mb is not None and w.ram_free_mb is not None and w.build_peak_ram_mb > w.ram_free_mb:
        signals.append(PEAK_RAM_SIGNAL)
    return tuple(signals)


def resource_saturation(w: WorkerView) -> float:
    return -SATURATION_PENALTY * len(saturation_signals(w))


def saturation_holds_back(signals: int, prioritized: bool = False) -> bool:
    """Whether `signals` ResourceSaturation signals keep every job off the worker: even the best
    WaitTime and EstimatedTime (and the Qos of a prioritized job) stay below the floor after them."""
    best = WAIT_CAP + ESTIMATE_CAP_SECS + (QOS_BONUS if prioritized else 0.0)
    return signals > 0 and best - SATURATION_PENALTY * signals < ASSIGNMENT_FLOOR


def score(c: Candidate, w: WorkerView, pool: PoolView, policy: str = RESOURCE_AWARE) -> Score:
    breakdown = {
        "WaitTime": wait_time(c, pool),
        "EstimatedTime": estimated_time(c, w),
        "Qos": qos(c),
        "ReserveFetchWorkers": reserve_fetch_workers(c, w, pool),
        "TransferLimit": transfer_limit(c, w),
    }
    if policy_name(policy) == RESOURCE_AWARE:
        breakdown["ResourceSaturation"] = resource_saturation(w)
    vetoed_by = "RescoreWait" if rescore_wait_vetoes(c) else None
    return Score(job_id=c.job_id, total=sum(breakdown.values()), breakdown=breakdown, vetoed_by=vetoed_by)


def rank(
    candidates: Iterable[Candidate], worker: WorkerView, pool: PoolView, policy: str = RESOURCE_AWARE
) -> list[Score]:
    """Every eligible candidate, best first: highest total, ties to the smaller job id."""
    scores = [score(c, worker, pool, policy) for c in candidates]
    return sorted((s for s in scores if s.eligible), key=lambda s: (-s.total, s.job_id))


def best(scores: Sequence[Score]) -> Score | None:
    return scores[0] if scores else None
