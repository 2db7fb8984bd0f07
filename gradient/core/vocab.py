"""The vocabulary: every status, kind and outcome Gradient stores or sends, each defined once.

Plain `enum.StrEnum`s, no Django: the models take their field choices from here (`choices(EnumCls)`,
the same (value, label) pairs Django's TextChoices gave, so the migrations do not change), the pure
decision modules and the record schemas use the very same classes, and the wire protocol's
`JobFailed.kind` is `FailureKind`. Values are stored verbatim (the reference notes' names), so SQL
readers, REST clients and the design pages all see the same words.

A StrEnum member is its value (`BuildStatus.QUEUED == "Queued"`, same hash), so a value read from a
row compares equal to the member and is found in the sets below.

Two pairs share a word but not a meaning, and are named for the difference:

- `JobKind` is a single job's kind (`eval`, `build`): what a worker runs, a dispatched_job row holds
  and a job key starts with. `RecordKind` is the kind of job that has a record (`evaluation`,
  `cluster`): the record header's `kind`. (records.schemas called it JobKind.)
- `JobKind` against `JobKindName`: the protocol names an evaluation job `flake` (RequestJob kind,
  JobCandidate kind); `job_kind_of` and `protocol_kind_name` translate.

Some of these had other names where they were defined before; those modules keep the old name as the
same class: scheduling.models and core.protocol `BuildFailureKind` (FailureKind), records.schemas
`JobKind` (RecordKind) and `AssignmentOutcome` (DispatchOutcome), clusters.decisions.types `SlotKind`
(JobKind), clusters.decisions.settlement `MemberOutcome` (SeatResult).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, Literal, TypeAlias, TypeVar

E = TypeVar("E", bound=enum.StrEnum)


# --- Job kinds ----------------------------------------------------------------------------------------


class JobKind(enum.StrEnum):
    """The two kinds of single job. The key prefix (`eval:`/`build:`) is its value; the protocol's
    RequestJob kind (`flake`/`build`) is `protocol_kind_name` of it."""

    EVAL = "eval"
    BUILD = "build"


JobKindName: TypeAlias = Literal["flake", "build"]
"""A job kind as the protocol names it (RequestJob.kind, JobCandidate.kind, the job's tag)."""

PROTOCOL_JOB_KINDS: Final[Mapping[str, JobKind]] = {"flake": JobKind.EVAL, "build": JobKind.BUILD}
_PROTOCOL_NAMES: Final[Mapping[JobKind, JobKindName]] = {JobKind.EVAL: "flake", JobKind.BUILD: "build"}


def job_kind_of(name: JobKindName) -> JobKind:
    """The protocol's kind name as the JobKind: `flake` is an evaluation job."""
    return PROTOCOL_JOB_KINDS[name]


def protocol_kind_name(kind: JobKind) -> JobKindName:
    """The JobKind as the protocol names it: an evaluation job is `flake`."""
    return _PROTOCOL_NAMES[kind]


class RecordKind(enum.StrEnum):
    """The kind of job that has a record (the record header's `kind`): an evaluation or a cluster job.
    Its shared builds have no record of their own."""

    EVALUATION = "evaluation"
    CLUSTER = "cluster"


class JobKeyKind(enum.StrEnum):
    """The prefix of a job key (gradient.core.jobkey): a single job's kind, or a cluster."""

    EVAL = "eval"
    BUILD = "build"
    CLUSTER = "cluster"

    @property
    def prefix(self) -> str:
        """`eval:`, `build:` or `cluster:`: for a `startswith` filter on a key column."""
        return f"{self.value}:"


# --- Evaluations --------------------------------------------------------------------------------------


class EvaluationStatus(enum.StrEnum):
    QUEUED = "Queued"
    FETCHING = "Fetching"
    EVALUATING_FLAKE = "EvaluatingFlake"
    EVALUATING_DERIVATION = "EvaluatingDerivation"
    BUILDING = "Building"
    WAITING = "Waiting"
    COMPLETED = "Completed"
    FAILED = "Failed"
    ABORTED = "Aborted"


EVALUATION_ACTIVE: Final = (
    EvaluationStatus.QUEUED,
    EvaluationStatus.FETCHING,
    EvaluationStatus.EVALUATING_FLAKE,
    EvaluationStatus.EVALUATING_DERIVATION,
    EvaluationStatus.BUILDING,
    EvaluationStatus.WAITING,
)
EVALUATION_TERMINAL: Final = (EvaluationStatus.COMPLETED, EvaluationStatus.FAILED, EvaluationStatus.ABORTED)
# Its evaluation job is on a worker.
EVALUATION_EVALUATING: Final = (
    EvaluationStatus.FETCHING,
    EvaluationStatus.EVALUATING_FLAKE,
    EvaluationStatus.EVALUATING_DERIVATION,
)


class EvaluationKind(enum.StrEnum):
    NORMAL = "Normal"
    DRV_RECOVERY = "DrvRecovery"


class FlakeSourceKind(enum.StrEnum):
    REPOSITORY = "repository"
    CACHED = "cached"


# --- Shared builds -------------------------------------------------------------------------------------

BUILTIN_SYSTEM: Final = "builtin"
"""A build of this system runs on any build worker: the architecture check is skipped."""


class BuildStatus(enum.StrEnum):
    CREATED = "Created"
    QUEUED = "Queued"
    BUILDING = "Building"
    COMPLETED = "Completed"
    FAILED_PERMANENT = "FailedPermanent"
    ABORTED = "Aborted"
    DEPENDENCY_FAILED = "DependencyFailed"
    SUBSTITUTED = "Substituted"
    FAILED_TRANSIENT = "FailedTransient"
    FAILED_TIMEOUT = "FailedTimeout"


BUILD_SUCCESS: Final = (BuildStatus.COMPLETED, BuildStatus.SUBSTITUTED)
BUILD_LASTING_FAILURE: Final = (
    BuildStatus.FAILED_PERMANENT,
    BuildStatus.DEPENDENCY_FAILED,
    BuildStatus.FAILED_TIMEOUT,
)
BUILD_PENDING: Final = (BuildStatus.CREATED, BuildStatus.QUEUED)
BUILD_ABORTABLE: Final = (BuildStatus.CREATED, BuildStatus.QUEUED, BuildStatus.BUILDING)
# Not finished: may still be handed out and succeed (pending, building, or waiting out a retry's backoff).
BUILD_UNFINISHED: Final = (*BUILD_ABORTABLE, BuildStatus.FAILED_TRANSIENT)


class BuildAttemptOutcome(enum.StrEnum):
    RUNNING = "Running"
    BUILT = "Built"
    SUBSTITUTED = "Substituted"
    FAILED = "Failed"
    ABORTED = "Aborted"


# --- Assignments and failures ---------------------------------------------------------------------------


class DispatchOutcome(enum.StrEnum):
    """dispatched_job.outcome: how an assignment closed (the record's AssignmentClosed.outcome)."""

    COMPLETED = "Completed"
    FAILED = "Failed"
    ABANDONED = "Abandoned"


class FailureKind(enum.StrEnum):
    """The protocol's failure kinds, as a worker reports them in JobFailed (the spec's
    BuildFailureKind; evaluation jobs fail with the same kinds)."""

    TRANSIENT = "transient"
    PERMANENT = "permanent"
    TIMEOUT = "timeout"
    SUBSTITUTE_UNAVAILABLE = "substitute_unavailable"
    INPUTS_UNAVAILABLE = "inputs_unavailable"
    ABORTED = "aborted"
    CANCELED = "canceled"  # the worker is stopping: requeue without spending an attempt


REQUEUEING_FAILURE_KINDS: Final = frozenset(
    {FailureKind.TRANSIENT, FailureKind.SUBSTITUTE_UNAVAILABLE, FailureKind.INPUTS_UNAVAILABLE}
)
"""Failure kinds that single-job handling answers with a retry (while attempts remain); a settled
cluster member never requeues alone."""


# --- Cluster jobs -------------------------------------------------------------------------------------


class ClusterStatus(enum.StrEnum):
    QUEUED = "Queued"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    ABORTED = "Aborted"


CLUSTER_ACTIVE: Final = (ClusterStatus.QUEUED, ClusterStatus.RUNNING)
CLUSTER_TERMINAL: Final = (ClusterStatus.COMPLETED, ClusterStatus.FAILED, ClusterStatus.ABORTED)


class AttemptOutcome(enum.StrEnum):
    """cluster_attempt.outcome."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    PREPARE_FAILED = "PrepareFailed"
    ABORTED = "Aborted"


class Verdict(enum.StrEnum):
    """The cluster verdict that closed an attempt (cluster-jobs.md, Recovery)."""

    COMPLETE = "Complete"
    RETRY = "Retry"
    FAIL = "Fail"
    ABORT = "Abort"


class SeatResult(enum.StrEnum):
    """What a seated member showed so far (cluster_seat.result; the settlement's MemberOutcome)."""

    RUNNING = "running"
    """No report yet."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"
    """Lost with its worker, or reaped after an unconfirmed abort."""
    EVALUATION_ABORTED = "evaluation_aborted"


# --- Records ------------------------------------------------------------------------------------------


class EntryKind(enum.StrEnum):
    """record_entry.kind: a control intent or a fact."""

    CONTROL = "control"
    FACT = "fact"


# --- Helpers ------------------------------------------------------------------------------------------

# Labels where Django's default (`NAME_PART` -> "Name Part") was not the one the choices carried.
_LABELS: Final[Mapping[type[enum.StrEnum], Mapping[str, str]]] = {JobKind: {"EVAL": "Evaluation"}}


def label(member: enum.StrEnum) -> str:
    """A member's human label: as Django's TextChoices derived it, unless one is given above."""
    given = _LABELS.get(type(member), {}).get(member.name)
    return given if given is not None else member.name.replace("_", " ").title()


def choices(cls: type[enum.StrEnum]) -> list[tuple[str, str]]:
    """A model field's `choices`: the (value, label) pairs TextChoices' `.choices` gave."""
    return [(member.value, label(member)) for member in cls]


def values(cls: type[enum.StrEnum]) -> tuple[str, ...]:
    """Every value of the enum, in definition order."""
    return tuple(member.value for member in cls)


def member_of(cls: type[E], value: object) -> E | None:
    """The member whose value this is, or None (for anything else, including non-strings)."""
    if not isinstance(value, str):
        return None
    try:
        return cls(value)
    except ValueError:
        return None
