"""The record's wire schemas, decoded strictly.

Three schema names, each a msgspec type:

- `gradient.header.v1`: the header, written once when the job is created.
- `gradient.control.v1`: control intents (what a person wants). FROZEN: never add, rename or remove a
  field or an intent here. A new intent gets a new schema name. Because control intents live apart
  from facts, an older build that cannot decode a newer record's facts can still append a cancel.
- `gradient.control.v2`: the operator's console actions that are no v1 intent (prioritize, rebuild,
  drain and deactivate a worker). Control intents too, and FROZEN like v1: an older build that cannot
  read them refuses them by their schema name, and can still append a v1 cancel.
- `gradient.fact.v1`: facts (the scheduler's decisions, the calls it is about to make, the evidence
  it gathered). A new or changed fact gets a new schema name that older builds refuse.

Decoding refuses an unknown schema, an unknown or missing field, a wrong type, malformed JSON and
trailing data with `SchemaError`, and an unknown enum value, intent or fact type with
`UnknownNameError`. Nothing is ever skipped.
"""

from __future__ import annotations

import enum
import hashlib
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final, TypeAlias

import msgspec

from gradient.core.jobkey import RECORD_KEYS, JobKey, JobKeyError, job_key
from gradient.core.vocab import AttemptOutcome as AttemptOutcome
from gradient.core.vocab import DispatchOutcome, RecordKind
from gradient.core.vocab import EntryKind as EntryKind
from gradient.core.vocab import Verdict as Verdict
from gradient.records.errors import SchemaError, UnknownNameError

HEADER_SCHEMA: Final = "gradient.header.v1"
CONTROL_SCHEMA: Final = "gradient.control.v1"
FACT_SCHEMA: Final = "gradient.fact.v1"
OPERATOR_SCHEMA: Final = "gradient.control.v2"


ENTRY_SCHEMAS: Final[Mapping[str, EntryKind]] = {
    CONTROL_SCHEMA: EntryKind.CONTROL,
    OPERATOR_SCHEMA: EntryKind.CONTROL,
    FACT_SCHEMA: EntryKind.FACT,
}


# --- Names ------------------------------------------------------------------------------------------------


JobKind = RecordKind
"""The kind of job a record is kept for (gradient.core.vocab.RecordKind; the old name)."""


def job_key_for(kind: RecordKind, job_id: uuid.UUID | str) -> str:
    return job_key(kind, job_id)


def parse_job_key(text: str) -> tuple[RecordKind, uuid.UUID]:
    """`eval:<uuid>` or `cluster:<uuid>` (lower-case canonical uuid); anything else is a SchemaError."""
    try:
        key = JobKey.require(text, kinds=RECORD_KEYS, canonical=True)
    except JobKeyError as exc:
        raise SchemaError(str(exc)) from None
    kind = key.record_kind
    assert kind is not None  # RECORD_KEYS
    return kind, key.id


class Desired(enum.StrEnum):
    RUN = "run"
    HOLD = "hold"
    CANCEL = "cancel"


class Outcome(enum.StrEnum):
    """A job's outcome. `none` is a known name (a Status says it while nothing is committed) but it is
    not terminal: a history that commits it is invalid."""

    NONE = "none"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_OUTCOMES: Final = frozenset({Outcome.SUCCEEDED, Outcome.FAILED, Outcome.CANCELLED})


AssignmentOutcome = DispatchOutcome
"""dispatched_job.outcome (gradient.core.vocab.DispatchOutcome; the old name)."""


class ReportKind(enum.StrEnum):
    """What a worker (or the pool, for `lost`) showed about an assignment."""

    ACCEPTED = "accepted"  # AssignJobResponse{accepted: true}
    DECLINED = "declined"  # AssignJobResponse{accepted: false}
    UPDATE = "update"  # JobUpdate
    COMPLETED = "completed"  # JobCompleted
    FAILED = "failed"  # JobFailed
    LOST = "lost"  # the worker disconnected or missed its heartbeats


class RowStatus(enum.StrEnum):
    """Every status an evaluation or cluster_job row can have (reference notes)."""

    QUEUED = "Queued"
    FETCHING = "Fetching"
    EVALUATING_FLAKE = "EvaluatingFlake"
    EVALUATING_DERIVATION = "EvaluatingDerivation"
    BUILDING = "Building"
    WAITING = "Waiting"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    ABORTED = "Aborted"


TERMINAL_ROW_STATUSES: Final = frozenset({RowStatus.COMPLETED, RowStatus.FAILED, RowStatus.ABORTED})
ROW_STATUS_OUTCOME: Final[Mapping[RowStatus, Outcome]] = {
    RowStatus.COMPLETED: Outcome.SUCCEEDED,
    RowStatus.FAILED: Outcome.FAILED,
    RowStatus.ABORTED: Outcome.CANCELLED,
}


class CallKind(enum.StrEnum):
    """A call the scheduler is about to make whose effect lands later: a deadline is recorded first."""

    HOLD = "hold"  # AssignJob with a cluster hold: the worker holds the slot until the deadline
    REQUEUE = "requeue"
    ABORT = "abort"  # AbortJob / AbortCluster


class ObjectTable(enum.StrEnum):
    """Where a submission's canonical object lives."""

    DISPATCHED_JOB = "dispatched_job"
    CLUSTER_ATTEMPT = "cluster_attempt"


# --- Header -----------------------------------------------------------------------------------------------


class Plan(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The values every actor decides this job with, whatever its own settings say."""

    max_attempts: int  # evaluation: lost dispatches before it fails; cluster: max(1, retry_budget)
    retry_budget: int  # cluster: bounds started attempts (0 or 1 allows one)
    prepare_timeout_secs: int  # clusterPrepareTimeoutSecs
    hold_margin_secs: int  # hold_secs = prepare timeout + this margin
    unbuildable_grace_secs: int
    heartbeat_timeout_secs: int  # workerHeartbeatTimeoutSecs; 0 disables


class Header(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    job_key: str
    kind: RecordKind
    spec: dict[str, Any]
    digest: str  # "sha256:<hex>" of the spec's canonical JSON
    plan: Plan
    created_by: str | None
    created_at: datetime
    supersedes: str | None
    generation: int  # 1, or one more than the job it supersedes


# --- Control intents: gradient.control.v1 (FROZEN) --------------------------------------------------------


class _Control(msgspec.Struct, tag_field="intent", forbid_unknown_fields=True, frozen=True, kw_only=True):
    reason: str = ""


class Cancel(_Control, tag="cancel", frozen=True):
    """Desired cancel, outcome cancelled at once, holds lifted, pending requeue/resubmit dropped,
    clean-up pending. Leaves an already committed outcome alone."""


class Hold(_Control, tag="hold", frozen=True):
    """Keep the job from new submissions until released."""


class Release(_Control, tag="release", frozen=True):
    """Lift every hold."""


class Requeue(_Control, tag="requeue", frozen=True):
    """End the current submission so the job is offered again."""


class GiveUp(_Control, tag="give_up", frozen=True):
    """Outcome failed, with the cause of the hold it ends if any, and an escalation."""


class Resubmit(_Control, tag="resubmit", frozen=True):
    """Once this job has an outcome, submit a new generation that supersedes it."""


class Abandon(_Control, tag="abandon", frozen=True):
    """Stop caring about the job's leftovers: outcome cancelled if none, and every object recorded so
    far (and any foreign one) no longer holds settling back."""


ControlIntent: TypeAlias = Cancel | Hold | Release | Requeue | GiveUp | Resubmit | Abandon
CONTROL_INTENTS: Final[tuple[type[_Control], ...]] = (
    Cancel,
    Hold,
    Release,
    Requeue,
    GiveUp,
    Resubmit,
    Abandon,
)


# --- Operator intents: gradient.control.v2 (FROZEN) -----------------------------------------------------


class _Operator(msgspec.Struct, tag_field="intent", forbid_unknown_fields=True, frozen=True, kw_only=True):
    reason: str = ""


class Prioritize(_Operator, tag="prioritize", frozen=True):
    """Move `target` (this job, or one of its shared builds: `build:<uuid>`) ahead of the queue (Qos)."""

    target: str


class Rebuild(_Operator, tag="rebuild", frozen=True):
    """Build `build` (`build:<uuid>`), a shared build this job needs, again: it is queued afresh."""

    build: str


class DrainWorker(_Operator, tag="drain_worker", frozen=True):
    """`worker`, running a job of this record, is drained: it gets nothing new, its jobs finish."""

    worker: str


class DeactivateWorker(_Operator, tag="deactivate_worker", frozen=True):
    """`worker`, running a job of this record, is deactivated: its session closes, its jobs are lost."""

    worker: str


OperatorIntent: TypeAlias = Prioritize | Rebuild | DrainWorker | DeactivateWorker
OPERATOR_INTENTS: Final[tuple[type[_Operator], ...]] = (Prioritize, Rebuild, DrainWorker, DeactivateWorker)
AnyControl: TypeAlias = ControlIntent | OperatorIntent
"""Every control intent a writer may commit, of either control schema."""


# --- Facts: gradient.fact.v1 ------------------------------------------------------------------------------


class ObjectRef(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A submission's canonical object: a dispatched_job row or a cluster_attempt row."""

    table: ObjectTable
    id: uuid.UUID

    def __str__(self) -> str:
        return f"{self.table.value}:{self.id}"


class Seat(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    role: str
    index: int
    worker: str


class _Fact(msgspec.Struct, tag_field="fact", forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class AssignmentClaimed(_Fact, tag="assignment_claimed", frozen=True):
    """The claim won: submission `submission` is authorized and its canonical object is the new
    dispatched_job row. `attempt` is the attempt number recorded before the AssignJob goes out."""

    submission: int
    assignment_id: uuid.UUID
    worker: str
    attempt: int
    cluster_attempt_id: uuid.UUID | None = None


class AssignmentClosed(_Fact, tag="assignment_closed", frozen=True):
    assignment_id: uuid.UUID
    outcome: DispatchOutcome
    reason: str = ""


class ClusterAttemptOpened(_Fact, tag="cluster_attempt_opened", frozen=True):
    """claim_cluster won: submission `submission` is the cluster_attempt row, claim number `attempt`."""

    submission: int
    cluster_attempt_id: uuid.UUID
    attempt: int
    seats: tuple[Seat, ...] = ()


class ClusterAttemptStarted(_Fact, tag="cluster_attempt_started", frozen=True):
    cluster_attempt_id: uuid.UUID


class ClusterAttemptClosed(_Fact, tag="cluster_attempt_closed", frozen=True):
    cluster_attempt_id: uuid.UUID
    outcome: AttemptOutcome
    verdict: Verdict | None = None
    reason: str = ""


class CallDeadline(_Fact, tag="call_deadline", frozen=True):
    """Recorded before a call whose effect lands later (a hold before each cluster AssignJob, a
    requeue, an abort): until the object ends or the deadline passes, settling waits."""

    call: CallKind
    object: ObjectRef
    deadline: datetime


class WorkerReport(_Fact, tag="worker_report", frozen=True):
    """Evidence: what a worker (or the pool) showed about an assignment."""

    assignment_id: uuid.UUID | None
    worker: str
    kind: ReportKind
    summary: str = ""


class StatusChanged(_Fact, tag="status_changed", frozen=True):
    """The job's row moved to `status`, in the same transaction as this fact."""

    status: RowStatus
    reason: str = ""


class OutcomeCommitted(_Fact, tag="outcome_committed", frozen=True):
    outcome: Outcome
    cause: str = ""


class Escalated(_Fact, tag="escalated", frozen=True):
    reason: str
    cause: str = ""


class Resubmitted(_Fact, tag="resubmitted", frozen=True):
    successor: str  # the job key of the new generation


class Settled(_Fact, tag="settled", frozen=True):
    pass


Fact: TypeAlias = (
    AssignmentClaimed
    | AssignmentClosed
    | ClusterAttemptOpened
    | ClusterAttemptStarted
    | ClusterAttemptClosed
    | CallDeadline
    | WorkerReport
    | StatusChanged
    | OutcomeCommitted
    | Escalated
    | Resubmitted
    | Settled
)
FACT_TYPES: Final[tuple[type[_Fact], ...]] = (
    AssignmentClaimed,
    AssignmentClosed,
    ClusterAttemptOpened,
    ClusterAttemptStarted,
    ClusterAttemptClosed,
    CallDeadline,
    WorkerReport,
    StatusChanged,
    OutcomeCommitted,
    Escalated,
    Resubmitted,
    Settled,
)

Body: TypeAlias = ControlIntent | OperatorIntent | Fact


def tag_of(body: Body) -> str:
    tag = type(body).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def intent_names() -> tuple[str, ...]:
    return tuple(str(t.__struct_config__.tag) for t in CONTROL_INTENTS)


def operator_intent_names() -> tuple[str, ...]:
    return tuple(str(t.__struct_config__.tag) for t in OPERATOR_INTENTS)


def fact_names() -> tuple[str, ...]:
    return tuple(str(t.__struct_config__.tag) for t in FACT_TYPES)


# --- Encoding and strict decoding -------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
_header_decoder = msgspec.json.Decoder(Header)
_control_decoder = msgspec.json.Decoder(ControlIntent)
_operator_decoder = msgspec.json.Decoder(OperatorIntent)
_fact_decoder = msgspec.json.Decoder(Fact)


def encode(value: Header | Body) -> str:
    """The exact JSON text stored for a header or an entry body."""
    return _encoder.encode(value).decode("utf-8")


def canonical_json(value: Mapping[str, Any] | msgspec.Struct) -> bytes:
    """Sorted keys, no whitespace: the same spec always gives the same bytes."""
    return msgspec.json.encode(msgspec.to_builtins(value), order="sorted")


def spec_digest(value: Mapping[str, Any] | msgspec.Struct) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(value)).hexdigest()


def _classify(
    exc: msgspec.MsgspecError, text: str | bytes, tag_field: str | None, known: frozenset[str]
) -> None:
    """Raise the records error for a msgspec refusal: names we do not know are UnknownNameError,
    everything else (malformed, trailing data, unknown or missing fields, wrong types) SchemaError."""
    if isinstance(exc, msgspec.ValidationError):
        message = str(exc)
        if message.startswith("Invalid enum value"):
            raise UnknownNameError(message) from exc
        if tag_field is not None:
            try:
                raw = msgspec.json.decode(text)
            except msgspec.DecodeError:
                raw = None
            if isinstance(raw, dict) and isinstance(raw.get(tag_field), str) and raw[tag_field] not in known:
                raise UnknownNameError(f"unknown {tag_field} {raw[tag_field]!r}") from exc
    raise SchemaError(str(exc)) from exc


_INTENT_NAMES = frozenset(intent_names())
_OPERATOR_NAMES = frozenset(operator_intent_names())
_FACT_NAMES = frozenset(fact_names())


def decode_header(text: str | bytes, *, schema: str = HEADER_SCHEMA) -> Header:
    if schema != HEADER_SCHEMA:
        raise SchemaError(f"unknown header schema {schema!r}")
    try:
        return _header_decoder.decode(text)
    except msgspec.MsgspecError as exc:
        _classify(exc, text, None, frozenset())
        raise  # unreachable: _classify always raises


def decode_control(text: str | bytes) -> ControlIntent:
    try:
        return _control_decoder.decode(text)
    except msgspec.MsgspecError as exc:
        _classify(exc, text, "intent", _INTENT_NAMES)
        raise


def decode_operator(text: str | bytes) -> OperatorIntent:
    try:
        return _operator_decoder.decode(text)
    except msgspec.MsgspecError as exc:
        _classify(exc, text, "intent", _OPERATOR_NAMES)
        raise


def decode_fact(text: str | bytes) -> Fact:
    try:
        return _fact_decoder.decode(text)
    except msgspec.MsgspecError as exc:
        _classify(exc, text, "fact", _FACT_NAMES)
        raise


def decode_body(schema: str, text: str | bytes) -> Body:
    """Decode an entry body by its schema name; an unknown schema is refused."""
    if schema == CONTROL_SCHEMA:
        return decode_control(text)
    if schema == FACT_SCHEMA:
        return decode_fact(text)
    if schema == OPERATOR_SCHEMA:
        return decode_operator(text)
    raise SchemaError(f"unknown entry schema {schema!r}")


def schema_for(body: Body) -> tuple[EntryKind, str]:
    if isinstance(body, _Control):
        return EntryKind.CONTROL, CONTROL_SCHEMA
    if isinstance(body, _Operator):
        return EntryKind.CONTROL, OPERATOR_SCHEMA
    return EntryKind.FACT, FACT_SCHEMA


# --- The history as it is read: raw entries ---------------------------------------------------------------


class RawEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One stored entry as read back: fold decodes `body` itself, strictly."""

    revision: int
    kind: str
    schema: str
    body: str
    actor: str
    recorded_at: datetime


class RecordView(msgspec.Struct, frozen=True, kw_only=True):
    """A record at one revision: its header and its entries 1..revision."""

    header: Header
    entries: tuple[RawEntry, ...]

    @property
    def revision(self) -> int:
        return len(self.entries)
