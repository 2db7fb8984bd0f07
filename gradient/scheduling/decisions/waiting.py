"""Waiting reasons: why an in-flight evaluation is not making progress, in a form an operator reads.

Pure functions over counters, blocking builds and the pool; the waiting pass (services.waiting) loads
those and writes the verdict only when its JSON changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from gradient.core.vocab import BUILTIN_SYSTEM, BuildStatus, EvaluationStatus
from gradient.scheduling.decisions.access import may_take
from gradient.scheduling.decisions.scoring import saturation_holds_back

UNBUILDABLE_GRACE_SECS = 300
MEMO_SECS = 60
LOST_DRV_GRACE_SECS = 120

# Reasons the waiting pass owns, and the ones it never touches (webhook and cache hooks own those).
PASS_REASONS = frozenset({"eval_workers", "workers", "saturated", "graph_stuck", "draining"})
FOREIGN_REASONS = frozenset({"approval", "no_cache", "cache_storage_full"})
# The parks of an evaluation whose own job completed (it was building).
BUILDING_PARKS = frozenset({"workers", "saturated", "graph_stuck"})

PRE_BUILD = frozenset(
    {
        EvaluationStatus.QUEUED,
        EvaluationStatus.FETCHING,
        EvaluationStatus.EVALUATING_FLAKE,
        EvaluationStatus.EVALUATING_DERIVATION,
    }
)
# Shared-build statuses that can still be wanted: a blocking build in one of these holds the evaluation.
STILL_WANTED = frozenset(
    {BuildStatus.CREATED, BuildStatus.QUEUED, BuildStatus.BUILDING, BuildStatus.FAILED_TRANSIENT}
)
HANDABLE = frozenset({BuildStatus.QUEUED, BuildStatus.BUILDING, BuildStatus.FAILED_TRANSIENT})


class Phase(StrEnum):
    PRE_BUILD = "pre_build"
    FINALIZE = "finalize"
    BUILDING = "building"
    ASSESS = "assess"


@dataclass(frozen=True, slots=True)
class Counters:
    named: int  # shared builds linked to the evaluation
    active: int  # of those, still wanted (not succeeded, no lasting failure, not aborted)
    building: int  # of those, Building right now
    aborted: int = 0  # of those, Aborted (by whatever path): the evaluation cannot finish on them

    def key(self) -> tuple[int, int, int, int]:
        return (self.named, self.active, self.building, self.aborted)


def phase_from_counters(c: Counters) -> Phase:
    """Counters first: decide without reading a shared build when they suffice. A needed build that was
    aborted is looked at at once, whatever else builds: the evaluation can never finish on it, and
    nothing but the heal brings it back."""
    if c.named == 0:
        return Phase.PRE_BUILD
    if c.aborted > 0:
        return Phase.ASSESS
    if c.active == 0:
        return Phase.FINALIZE
    if c.building > 0:
        return Phase.BUILDING
    return Phase.ASSESS


@dataclass(frozen=True, slots=True)
class PoolWorker:
    can_fetch: bool
    can_eval: bool
    can_build: bool
    architectures: tuple[str, ...]
    system_features: tuple[str, ...]
    draining: bool = False
    # The projects whose jobs it may take (access.may_take); None: not known here, so not checked.
    projects: frozenset[str] | None = None
    # The ResourceSaturation signals its fresh metrics show ("CPU > 80 %"); none under `simple`.
    saturation: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Pool:
    workers: tuple[PoolWorker, ...]

    def fingerprint(self) -> tuple[Any, ...]:
        return tuple(
            sorted(
                (
                    w.can_fetch,
                    w.can_eval,
                    w.can_build,
                    w.architectures,
                    w.system_features,
                    w.draining,
                    tuple(sorted(w.projects or ())),
                    w.saturation,
                )
                for w in self.workers
            )
        )

    @property
    def available(self) -> tuple[PoolWorker, ...]:
        return tuple(w for w in self.workers if not w.draining)

    def available_architectures(self) -> list[str]:
        return sorted({a for w in self.available if w.can_build for a in w.architectures})

    def fits(self, system: str, features: Iterable[str], projects: Iterable[str] | None = None) -> bool:
        """Some available worker can build it; with `projects`, one that may also take it for one of
        them."""
        return bool(self.capable(system, features, projects))

    def capable(
        self, system: str, features: Iterable[str], projects: Iterable[str] | None = None
    ) -> list[int]:
        """The available workers (their indexes in `available`) that can build it; with `projects`,
        only those that may also take it for one of them."""
        needed = set(features)
        wanted_by = None if projects is None else frozenset(projects)
        return [
            i
            for i, w in enumerate(self.available)
            if w.can_build
            and (system == BUILTIN_SYSTEM or system in w.architectures)
            and needed <= set(w.system_features)
            and _serves(w, wanted_by)
        ]

    def serving_projects(self, capable: Iterable[PoolWorker]) -> list[str]:
        return sorted({p for w in capable for p in (w.projects or ())})


def _serves(worker: PoolWorker, projects: frozenset[str] | None) -> bool:
    if projects is None or worker.projects is None:
        return True
    return may_take(worker.projects, projects)


@dataclass(frozen=True, slots=True)
class BlockingBuild:
    build_id: str
    status: str
    system: str
    required_features: tuple[str, ...]
    # The projects of the active evaluations that need it; None: not checked.
    projects: tuple[str, ...] | None = None
    name: str = ""  # the derivation's name (hello-2.12), for a reason that names the build
    prioritized: bool = False  # its Qos bonus may carry it past one saturation signal


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the waiting pass writes: a reason (None: not waiting) and where to unpark to."""

    reason: dict[str, Any] | None
    finalize: bool = False

    @property
    def name(self) -> str | None:
        return None if self.reason is None else str(self.reason["reason"])


NOT_WAITING = Verdict(None)


def draining_verdict(status: str, parked_for: str | None) -> Verdict:
    """The drain park, with where the evaluation resumes: Building only when it was building (its
    evaluation job completed); anything before that is evaluated again."""
    building = status == EvaluationStatus.BUILDING or (
        status == EvaluationStatus.WAITING and parked_for in BUILDING_PARKS
    )
    resume = EvaluationStatus.BUILDING if building else EvaluationStatus.QUEUED
    return Verdict({"reason": "draining", "resume": resume.value})


def pre_build_verdict(status: str, has_open_job: bool, pool: Pool, project: str | None = None) -> Verdict:
    """Fetching without a fetch worker; Queued or Evaluating* without an eval worker; or with such
    workers, none of which may take the evaluation's `project` (then the reason names the project and
    what the capable workers serve, and it is aborted after the grace like unbuildable work). An
    evaluation whose job is on a worker right now is not waiting."""
    if has_open_job or status not in PRE_BUILD:
        return NOT_WAITING
    capability = "fetch" if status in (EvaluationStatus.QUEUED, EvaluationStatus.FETCHING) else "eval"
    connected = len(pool.available)
    if capability == "fetch" and not any(w.can_fetch for w in pool.available):
        return Verdict({"reason": "eval_workers", "capability": "fetch", "connected_workers": connected})
    if not any(w.can_eval for w in pool.available):
        return Verdict({"reason": "eval_workers", "capability": "eval", "connected_workers": connected})
    if project is None:
        return NOT_WAITING
    for needed in ("fetch", "eval") if capability == "fetch" else ("eval",):
        capable = [w for w in pool.available if (w.can_fetch if needed == "fetch" else w.can_eval)]
        if not any(_serves(w, frozenset({project})) for w in capable):
            return Verdict(
                {
                    "reason": "eval_workers",
                    "capability": needed,
                    "connected_workers": connected,
                    "project": project,
                    "capable_workers": len(capable),
                    "serving_projects": pool.serving_projects(capable),
                }
            )
    return NOT_WAITING


MAX_NAMED_ABORTED = 10  # aborted builds a reason names; `aborted_count` says how many there are


def building_verdict(blocking: Sequence[BlockingBuild], pool: Pool) -> Verdict:
    """A blocking build that was aborted (by a cancel's race, a cluster's settlement, anything):
    `graph_stuck` naming it (`aborted_builds`), so the heal queues it again. Else building with no
    worker fitting a blocking build: `workers` with the unmet (architecture, features) sets, and
    (`unserved`) the builds that fitting workers exist for but none of which may take them for a
    project that needs them; every blocking build fits a worker yet none can be handed out:
    `graph_stuck`."""
    wanted = [b for b in blocking if b.status in STILL_WANTED]
    aborted = sorted(
        (b for b in blocking if b.status == BuildStatus.ABORTED), key=lambda b: (b.name, b.build_id)
    )
    if aborted:
        return Verdict(
            {
                "reason": "graph_stuck",
                "pending_shared_builds": len(wanted),
                "aborted_builds": [{"id": b.build_id, "name": b.name} for b in aborted[:MAX_NAMED_ABORTED]],
                "aborted_count": len(aborted),
            }
        )
    if not wanted:
        return Verdict(None, finalize=True)
    unmet: dict[tuple[str, tuple[str, ...]], int] = {}
    unserved: dict[tuple[str, ...], int] = {}
    for b in wanted:
        if b.status == BuildStatus.BUILDING:
            continue
        if not pool.fits(b.system, b.required_features):
            key = (b.system, tuple(sorted(b.required_features)))
            unmet[key] = unmet.get(key, 0) + 1
        elif b.projects is not None and not pool.fits(b.system, b.required_features, b.projects):
            projects = tuple(sorted(set(b.projects)))
            unserved[projects] = unserved.get(projects, 0) + 1
    if unmet or unserved:
        reason: dict[str, Any] = {
            "reason": "workers",
            "unmet": [
                {"architecture": arch, "required_features": list(feats), "builds": n}
                for (arch, feats), n in sorted(unmet.items())
            ],
            "connected_workers": len(pool.available),
            "available_architectures": pool.available_architectures(),
        }
        if unserved:
            builders = [w for w in pool.available if w.can_build]
            reason["unserved"] = [{"projects": list(p), "builds": n} for p, n in sorted(unserved.items())]
            reason["serving_projects"] = pool.serving_projects(builders)
        return Verdict(reason)
    saturated = saturated_verdict(wanted, pool)
    if saturated is not None:
        return saturated
    if any(b.status in HANDABLE for b in wanted):
        return NOT_WAITING
    return Verdict({"reason": "graph_stuck", "pending_shared_builds": len(wanted)})


def saturated_verdict(wanted: Sequence[BlockingBuild], pool: Pool) -> Verdict | None:
    """`saturated` when every Queued build is held back by ResourceSaturation: each worker that can
    build it reports enough load (scoring.saturation_holds_back) that no score reaches the floor. The
    reason counts those workers and each signal among them, for "3 workers can build it; all report
    CPU > 80 %". None when some Queued build can go (or none is Queued)."""
    queued = [b for b in wanted if b.status == BuildStatus.QUEUED]
    if not queued:
        return None
    held_on: set[int] = set()
    for b in queued:
        capable = pool.capable(b.system, b.required_features, b.projects)
        workers = [pool.available[i] for i in capable]
        if not workers or not all(saturation_holds_back(len(w.saturation), b.prioritized) for w in workers):
            return None
        held_on.update(capable)
    signals: dict[str, int] = {}
    for i in sorted(held_on):
        for signal in pool.available[i].saturation:
            signals[signal] = signals.get(signal, 0) + 1
    return Verdict(
        {
            "reason": "saturated",
            "builds": len(queued),
            "capable_workers": len(held_on),
            "signals": dict(sorted(signals.items())),
        }
    )


def assess(
    *,
    status: str,
    counters: Counters,
    has_open_job: bool,
    pool: Pool,
    blocking: Sequence[BlockingBuild] | None,
    draining: bool = False,
    parked_for: str | None = None,
    project: str | None = None,
) -> Verdict:
    """The whole decision for one evaluation. `blocking` may be None when the counters decide.

    An evaluation whose evaluation job has not completed (Queued, Fetching, Evaluating*, or Waiting parked
    before building: `parked_for` eval_workers, or no builds yet) is judged by the pre-build rules even
    when it has builds from an interrupted run's eval_result: it is never finalized on them, it is
    evaluated again. While the service drains, every in-flight evaluation that is not finished is parked
    as `draining`."""
    phase = phase_from_counters(counters)
    pre_build = status in PRE_BUILD or (
        status == EvaluationStatus.WAITING and (phase == Phase.PRE_BUILD or parked_for == "eval_workers")
    )
    if draining:
        if phase == Phase.FINALIZE and not pre_build:
            return Verdict(None, finalize=True)
        return draining_verdict(status, parked_for)
    if pre_build:
        queued = EvaluationStatus.QUEUED if status == EvaluationStatus.WAITING else status
        return pre_build_verdict(queued, has_open_job, pool, project)
    if phase == Phase.FINALIZE:
        return Verdict(None, finalize=True)
    if phase == Phase.BUILDING:
        return NOT_WAITING
    return building_verdict(blocking or (), pool)


def evaluation_job_done(status: str, reason: dict[str, Any] | None) -> bool:
    """Whether the evaluation's own job completed: Building, or Waiting parked while building (workers,
    graph_stuck, or a drain that resumes to Building). A Waiting evaluation parked for eval_workers (or a
    drain resuming to Queued) still needs its evaluation job."""
    if status == EvaluationStatus.BUILDING:
        return True
    if status != EvaluationStatus.WAITING or not reason:
        return False
    name = reason.get("reason")
    resumes_building = reason.get("resume") == EvaluationStatus.BUILDING
    return name in BUILDING_PARKS or (name == "draining" and resumes_building)


def unpark_status(reason: dict[str, Any] | None, named: int) -> EvaluationStatus:
    """Where an evaluation goes when its reason clears. A drain park says where it resumes (Building only
    when its evaluation job had completed: its builds are queued already). An eval_workers park still
    needs its evaluation job, even with builds from an eval_result whose job never completed: Queued.
    A workers or graph_stuck park goes back to Building."""
    name = (reason or {}).get("reason")
    if name == "draining":
        resumes_building = (reason or {}).get("resume") == EvaluationStatus.BUILDING and named > 0
        return EvaluationStatus.BUILDING if resumes_building else EvaluationStatus.QUEUED
    if name == "eval_workers" or named == 0:
        return EvaluationStatus.QUEUED
    return EvaluationStatus.BUILDING


@dataclass(frozen=True, slots=True)
class ClosureBuild:
    """A shared build of a stuck evaluation's closure, as the lost-.drv check sees it."""

    build_id: str
    status: str
    drv_lost: bool
    dependencies_done: bool
    outputs_cached: bool


def lost_drv_due(*, reason: dict[str, Any] | None, waiting_since: datetime | None, now: datetime) -> bool:
    """graph_stuck for longer than the lost-.drv grace (120 s)."""
    if reason is None or reason.get("reason") != "graph_stuck" or waiting_since is None:
        return False
    return (now - waiting_since).total_seconds() >= LOST_DRV_GRACE_SECS


def lost_drv_targets(closure: Iterable[ClosureBuild]) -> list[str]:
    """Builds a DrvRecovery evaluation can unstick: still needing a build (Created), not in the cache,
    every dependency done, and their .drv lost."""
    return sorted(
        b.build_id
        for b in closure
        if b.status == BuildStatus.CREATED and b.drv_lost and b.dependencies_done and not b.outputs_cached
    )


class DrvRecoveryAction(StrEnum):
    START = "start"  # start a DrvRecovery evaluation of the same commit for the build
    WAIT = "wait"  # one is running already
    GIVE_UP = "give_up"  # one ran and the .drv is still lost: the build fails for good


def drv_recovery_action(*, active_recoveries: int, finished_recoveries: int) -> DrvRecoveryAction:
    if active_recoveries:
        return DrvRecoveryAction.WAIT
    if finished_recoveries:
        return DrvRecoveryAction.GIVE_UP
    return DrvRecoveryAction.START


def abortable(reason: dict[str, Any] | None) -> bool:
    """A park the grace ends with an abort: a `workers` park with builds no connected worker can
    build (`unmet`) or may take (`unserved`), and an `eval_workers` park naming a project that no
    capable worker serves. A missing capability alone is only waited for (design: eval_workers)."""
    if reason is None:
        return False
    if reason.get("reason") == "workers":
        return bool(reason.get("unmet") or reason.get("unserved"))
    return reason.get("reason") == "eval_workers" and bool(reason.get("project"))


def same_park(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """The same park on the same missing things: its waiting_since (the grace's start) is kept."""
    keys = ("reason", "unmet", "unserved", "project", "capability")
    return old is not None and all(old.get(k) == new.get(k) for k in keys)


def load_shift_only(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """A `saturated` park that stays one, only its workers' load said differently: not a new park."""
    return old is not None and old.get("reason") == new.get("reason") == "saturated"


def unbuildable_due(
    *,
    reason: dict[str, Any] | None,
    waiting_since: datetime | None,
    wait_for_workers: bool,
    pool_stable_since: datetime,
    now: datetime,
    grace_secs: int = UNBUILDABLE_GRACE_SECS,
) -> bool:
    """An abortable park (a `workers` park with unmet or unserved builds, an `eval_workers` park naming
    a project), older than the grace, on a pool that has had the grace to come back since the last
    server start: hand it back to be aborted. wait_for_workers opts out."""
    if wait_for_workers or not abortable(reason):
        return False
    if waiting_since is None:
        return False
    grace = timedelta(seconds=grace_secs)
    return now - waiting_since >= grace and now - pool_stable_since >= grace


def unbuildable_warning(reason: dict[str, Any]) -> str:
    if reason.get("reason") == "eval_workers":
        return f"aborted: {unserved_words(reason)}"
    parts = []
    for u in reason.get("unmet", []):
        features = ", ".join(u["required_features"]) or "no features"
        parts.append(f"{u['architecture']} with {features} ({u['builds']} builds)")
    said = ["no worker can build " + "; ".join(parts)] if parts else []
    if reason.get("unserved"):
        said.append(unserved_words(reason))
    return "aborted: " + "; ".join(said)


def unserved_words(reason: dict[str, Any]) -> str:
    """ "no connected worker serves project rest-proj; 3 connected serve: demo"."""
    if reason.get("reason") == "eval_workers":
        projects = [str(reason.get("project"))]
        capable = reason.get("capable_workers", 0)
    else:
        projects = sorted({p for u in reason.get("unserved", []) for p in u["projects"]})
        capable = reason.get("connected_workers", 0)
    serving = ", ".join(reason.get("serving_projects", [])) or "no project"
    noun = "project" if len(projects) == 1 else "projects"
    return f"no connected worker serves {noun} {', '.join(projects)}; {capable} connected serve: {serving}"


def aborted_words(reason: dict[str, Any]) -> str:
    """ "it needs 2 shared builds that were aborted: hello-2.12, openssl-3.0.13"."""
    named = [str(b.get("name") or str(b.get("id", ""))[:8]) for b in reason.get("aborted_builds", [])]
    count = int(reason.get("aborted_count", len(named)))
    more = f" and {count - len(named)} more" if count > len(named) else ""
    noun = "a shared build that was" if count == 1 else f"{count} shared builds that were"
    return f"it needs {noun} aborted: {', '.join(named)}{more}"


def saturation_words(reason: dict[str, Any]) -> str:
    """ "3 workers can build it; all report CPU > 80 %"."""
    workers = int(reason.get("capable_workers", 0))
    signals: dict[str, int] = reason.get("signals", {})
    can = "1 worker can build it" if workers == 1 else f"{workers} workers can build it"
    shared = [s for s, n in signals.items() if n == workers]
    if shared:
        who = "it reports" if workers == 1 else "all report"
        return f"{can}; {who} {' and '.join(shared)}"
    each = ", ".join(f"{n} {'reports' if n == 1 else 'report'} {s}" for s, n in signals.items())
    return f"{can}; all are saturated: {each}"


def describe(reason: dict[str, Any] | None) -> str:
    """The reason in words an operator understands."""
    if not reason:
        return ""
    name = reason.get("reason")
    if name == "eval_workers" and reason.get("project"):
        capability = reason.get("capability")
        return f"Waiting for a worker that can {capability} for its project: {unserved_words(reason)}."
    if name == "eval_workers":
        return (
            f"Waiting for a worker that can {reason.get('capability')}: none of the "
            f"{reason.get('connected_workers', 0)} connected workers can."
        )
    if name == "workers" and not reason.get("unmet"):
        return f"Waiting for workers: {unserved_words(reason)}."
    if name == "workers":
        needs = "; ".join(
            f"{u['architecture']}"
            + (f" with {', '.join(u['required_features'])}" if u["required_features"] else "")
            + f" ({u['builds']} builds)"
            for u in reason.get("unmet", [])
        )
        archs = ", ".join(reason.get("available_architectures", [])) or "none"
        also = f" Also {unserved_words(reason)}." if reason.get("unserved") else ""
        return (
            f"Waiting for workers: no connected worker can build {needs}. "
            f"{reason.get('connected_workers', 0)} workers connected; architectures available: {archs}."
            + also
        )
    if name == "saturated":
        return f"Held back by ResourceSaturation: {saturation_words(reason)}."
    if name == "graph_stuck" and reason.get("aborted_builds"):
        them = "it" if int(reason.get("aborted_count", 1)) == 1 else "them"
        return f"Stuck: {aborted_words(reason)}; the graph repair queues {them} again."
    if name == "graph_stuck":
        return (
            f"Stuck: {reason.get('pending_shared_builds', 0)} shared builds are pending but none can start; "
            "the graph repair is running."
        )
    if name == "draining":
        return "Waiting: the server is draining; the evaluation resumes when it is back."
    return f"Waiting: {name}."


@dataclass
class AssessmentMemo:
    """Reuse a verdict for up to 60 s while the counters and the pool fingerprint stay equal."""

    ttl_secs: float = MEMO_SECS
    entries: dict[str, tuple[datetime, tuple[Any, ...], Verdict]] = field(default_factory=dict)

    def get(self, key: str, fingerprint: tuple[Any, ...], now: datetime) -> Verdict | None:
        hit = self.entries.get(key)
        if hit is None:
            return None
        at, fp, verdict = hit
        if fp != fingerprint or (now - at).total_seconds() > self.ttl_secs:
            return None
        return verdict

    def put(self, key: str, fingerprint: tuple[Any, ...], verdict: Verdict, now: datetime) -> None:
        self.entries[key] = (now, fingerprint, verdict)


def unbuildable_deadline(
    *,
    reason: dict[str, Any] | None,
    waiting_since: datetime | None,
    wait_for_workers: bool,
    pool_stable_since: datetime,
    grace_secs: int = UNBUILDABLE_GRACE_SECS,
) -> datetime | None:
    """When the waiting pass aborts a `workers` park (unbuildable_due turns true), or None when it never
    will (wait_for_workers, another reason, nothing unmet)."""
    if wait_for_workers or not abortable(reason):
        return None
    if waiting_since is None:
        return None
    grace = timedelta(seconds=grace_secs)
    return max(waiting_since + grace, pool_stable_since + grace)


def clock_time(at: datetime) -> str:
    """A deadline in words for a reader without a page that keeps it current (REST): "at 07:13:02 UTC"."""
    return f"at {at:%H:%M:%S} UTC"


def what_happens_next(
    *,
    reason: dict[str, Any] | None,
    deadline: datetime | None,
    wait_for_workers: bool,
    at: Callable[[datetime], str] = clock_time,
) -> str:
    """A waiting evaluation's next step in words: "aborted at 07:13:02 UTC unless a worker for
    aarch64-linux (kvm) connects", the deadline as `at` says it (the console: "in 4 min 59 s", kept
    current). Empty when it is not waiting."""
    if not reason:
        return ""
    name = reason.get("reason")
    if reason.get("project") or (name == "workers" and not reason.get("unmet")):
        projects = reason.get("project") or ", ".join(
            sorted({p for u in reason.get("unserved", []) for p in u["projects"]})
        )
        if deadline is not None:
            return f"aborted {at(deadline)} unless a worker serving {projects} connects"
        return f"runs once a worker serving {projects} connects"
    if name == "workers":
        wanted = "; ".join(
            u["architecture"]
            + (f" ({', '.join(u['required_features'])})" if u.get("required_features") else "")
            for u in reason.get("unmet", [])
        )
        if deadline is not None:
            return f"aborted {at(deadline)} unless a worker for {wanted} connects"
        if wait_for_workers:
            return f"waits until a worker for {wanted or 'it'} connects (wait_for_workers: never aborted)"
        return f"builds once a worker for {wanted or 'it'} connects"
    if name == "eval_workers":
        return f"runs once a worker that can {reason.get('capability', 'evaluate')} connects"
    if name == "saturated":
        return "builds once one of those workers reports less load (or another that can build it connects)"
    if name == "draining":
        return "resumes once a server that is not draining serves"
    if name == "graph_stuck" and reason.get("aborted_builds"):
        return "the graph repair queues the aborted builds again; it builds on once they are queued"
    if name == "graph_stuck":
        return "the waiting pass repairs its graph (a DrvRecovery evaluation if a .drv is lost)"
    return "runs once what it waits for is there"
