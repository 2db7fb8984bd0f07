"""The worker protocol (v1) as typed messages: ../shared/spec/protocol.md, word for word.

Every frame is one JSON object whose `type` names the message; fields sit beside it in snake_case.
Decoding is strict: an unknown `type`, an unknown or missing field, or a wrong type is a
`ProtocolError`, which the server answers with `Error{400}` and close code 4400. Optional fields may be
omitted or `null`; this module encodes them as `null`.

Text is text (protocol.md): a string on the wire may hold any character JSON can carry, but two of
them cannot be stored or passed on as text: NUL (U+0000, which PostgreSQL's text and jsonb refuse) and a
lone UTF-16 surrogate (`"\ud800"` without its pair, which no UTF-8 encoder writes). Decoding turns each
into U+FFFD REPLACEMENT CHARACTER, in every string of every message, keys included, so nothing a worker
reports can fail on them further in. A surrogate pair (escaped, or as two code points of a Python str)
is the one character it spells.

This module is plain msgspec with no Django import, so the reference worker (gradient.workers.client)
uses the very same structs as the server. The failure kinds and the job kind names are
gradient.core.vocab's (FailureKind, JobKindName), shared with the models and the decision modules.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Final, Literal, TypeAlias

import msgspec
from msgspec import Meta

from gradient.core.vocab import FailureKind
from gradient.core.vocab import JobKindName as JobKindName

PROTOCOL_VERSION: Final = 1
MAX_FRAME_BYTES: Final = 1024 * 1024  # 1 MiB: anything larger is a protocol violation
MAX_CANDIDATES_PER_FRAME: Final = 1000  # JobListChunk and JobOffer pages
MAX_SIGNAL_PAYLOAD_BYTES: Final = 64 * 1024  # ClusterSignal.payload
MAX_LOG_PIECE_BYTES: Final = 64 * 1024  # BuildLog.data
MAX_KNOWN_QUERY_PATHS: Final = 1000  # QueryKnownDerivations.drv_paths

# Close codes: a Reject closes with 4000 + its code; every protocol violation with 4400.
CLOSE_PROTOCOL_ERROR: Final = 4400

# Integers stored in 32-bit columns are bounded here, so a value the database cannot hold is a wrong
# type (400) instead of a database error.
_I32_MAX = 2**31 - 1
_I64_MAX = 2**63 - 1
NonNegInt32 = Annotated[int, Meta(ge=0, le=_I32_MAX)]
NonNegInt64 = Annotated[int, Meta(ge=0, le=_I64_MAX)]
NonNegFloat = Annotated[float, Meta(ge=0)]

FlakeStep: TypeAlias = Literal["FetchFlake", "EvaluateFlake", "EvaluateDerivations"]


class ProtocolError(ValueError):
    """A frame that is not a valid message: invalid JSON, unknown type, unknown or missing field,
    wrong type, or too large."""


BuildFailureKind = FailureKind
"""The spec's name for the failure kinds (gradient.core.vocab.FailureKind)."""


class Shape(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every nested shape: unknown fields are refused."""


# --- Shapes ----------------------------------------------------------------------------------------


class InitCapabilities(Shape):
    fetch: bool
    eval: bool
    build: bool


class RequiredPath(Shape):
    path: str
    nar_size: NonNegInt64 | None = None  # present when the path is in the cache


class BuildRequirement(Shape):
    architecture: str  # "builtin" skips the system check
    required_features: list[str]


class JobCandidate(Shape):
    job_id: str
    kind: JobKindName
    required_paths: list[RequiredPath]
    drv_paths: list[str]
    output_paths: list[str]
    requirement: BuildRequirement | None = None  # only on build candidates


class CandidateScore(Shape):
    job_id: str
    missing_count: NonNegInt32
    missing_nar_size: NonNegInt64
    outputs_present: bool


class FlakeSourceBase(Shape, tag_field="kind"):
    pass


class RepositorySource(FlakeSourceBase, tag="repository"):
    url: str
    commit: str


class CachedSource(FlakeSourceBase, tag="cached"):
    store_path: str


FlakeSource: TypeAlias = RepositorySource | CachedSource


class OutputPath(Shape):
    name: str
    path: str


class BuiltOutput(Shape):
    name: str
    path: str
    nar_size: NonNegInt64


class CachedOutput(Shape):
    path: str
    nar_size: NonNegInt64


class BuildSpec(Shape):
    build_id: str
    drv_path: str
    outputs: list[OutputPath]
    timeout_secs: NonNegInt32
    max_silent_secs: NonNegInt32


class JobBase(Shape, tag_field="kind"):
    pass


class FlakeJob(JobBase, tag="flake"):
    steps: list[FlakeStep]
    source: FlakeSource
    wildcards: list[str]
    timeout_secs: NonNegInt32


class BuildJob(JobBase, tag="build"):
    builds: list[BuildSpec]
    requirement: BuildRequirement


Job: TypeAlias = FlakeJob | BuildJob


class ClusterMembership(Shape):
    attempt: str
    role: str
    index: NonNegInt32
    hold_secs: NonNegInt32


class ClusterAddress(Shape):
    role: str
    index: NonNegInt32


class ClusterPeer(Shape):
    role: str
    index: NonNegInt32
    worker_id: str
    zone: str | None = None
    endpoint: str | None = None


class DiscoveredDerivation(Shape):
    drv_path: str
    system: str
    required_features: list[str]
    outputs: list[OutputPath]
    input_drvs: list[str]
    cached_outputs: list[CachedOutput]
    attr: str | None = None


class JobUpdateKindBase(Shape, tag_field="kind"):
    pass


class Fetching(JobUpdateKindBase, tag="fetching"):
    pass


class EvaluatingFlake(JobUpdateKindBase, tag="evaluating_flake"):
    pass


class EvaluatingDerivations(JobUpdateKindBase, tag="evaluating_derivations"):
    pass


class FetchResult(JobUpdateKindBase, tag="fetch_result"):
    flake_source: str  # the store path the fetch produced


class EvalResult(JobUpdateKindBase, tag="eval_result"):
    """One eval_result, or one part of a result too large for a frame: every part but the last has
    `is_final: false`; absent (null) means true, so one frame is a whole result ("Large evaluations")."""

    derivations: list[DiscoveredDerivation]
    warnings: list[str]
    errors: list[str]
    is_final: bool | None = None
    # Derivations the server said it knows (KnownDerivations), left out with their closures ("Known
    # derivations"): linked as if sent.
    known_drvs: list[str] | None = None


class Building(JobUpdateKindBase, tag="building"):
    build_id: str


class BuildOutput(JobUpdateKindBase, tag="build_output"):
    build_id: str
    outputs: list[BuiltOutput]
    substituted: bool


JobUpdateKind: TypeAlias = (
    Fetching | EvaluatingFlake | EvaluatingDerivations | FetchResult | EvalResult | Building | BuildOutput
)


# --- Messages --------------------------------------------------------------------------------------


class Message(Shape, tag_field="type", tag=True):
    """Base of every frame; the tag (`type`) is the class name unless a subclass says otherwise."""


# Worker -> server


class InitConnection(Message):
    worker_id: str
    token: str
    capabilities: InitCapabilities
    protocol: int


class WorkerCapabilities(Message):
    architectures: list[str]
    system_features: list[str]
    max_concurrent_builds: NonNegInt32
    cpu_count: NonNegInt32
    ram_total_mb: NonNegInt32
    cpu_core_score: NonNegInt32
    zone: Annotated[str, Meta(max_length=200)] | None = None
    endpoint: Annotated[str, Meta(max_length=500)] | None = None


class WorkerMetrics(Message):
    """The 10 s heartbeat."""

    cpu_usage_pct: NonNegFloat | None = None
    ram_free_mb: NonNegInt32 | None = None
    disk_speed_mbps: NonNegFloat | None = None
    upload_speed_mbps: NonNegFloat | None = None
    download_speed_mbps: NonNegFloat | None = None
    build_peak_ram_mb: NonNegInt32 | None = None


class RequestJobList(Message):
    pass


class RequestJobChunk(Message):
    scores: list[CandidateScore]
    is_final: bool


class RequestJob(Message):
    kind: JobKindName


class AssignJobResponse(Message):
    job_id: str
    assignment_id: str
    accepted: bool
    reason: str | None = None


class JobUpdate(Message):
    job_id: str
    assignment_id: str
    update: JobUpdateKind


class JobCompleted(Message):
    job_id: str
    assignment_id: str
    elapsed_ms: NonNegInt64


class JobFailed(Message):
    job_id: str
    assignment_id: str
    error: str
    kind: FailureKind
    elapsed_ms: NonNegInt64
    missing_paths: list[str] | None = None


class BuildProgress(Message):
    job_id: str
    assignment_id: str
    build_id: str
    phase: Literal["download", "prefetch", "upload"]
    bytes_done: NonNegInt64
    bytes_total: NonNegInt64 | None = None


class EvalProgress(Message):
    job_id: str
    assignment_id: str
    phase: Literal["fetching", "evaluating"]
    done: NonNegInt64
    total: NonNegInt64 | None = None


class ClusterSignal(Message):
    """A worker's signal to the other members of its started attempt (`to` absent: all of them)."""

    attempt: str
    payload: str
    to: ClusterAddress | None = None

    def __post_init__(self) -> None:
        # Checked in bytes, as the wire carries it; raising here makes it a ValidationError.
        if len(self.payload) * 4 > MAX_SIGNAL_PAYLOAD_BYTES and (
            len(self.payload.encode()) > MAX_SIGNAL_PAYLOAD_BYTES
        ):
            raise ValueError(f"payload is larger than {MAX_SIGNAL_PAYLOAD_BYTES} bytes")


class BuildLog(Message):
    """The next piece of one build's log (its builder's stdout and stderr, as text): `offset` is the
    position, in characters of this assignment's log of that build, of the first character of `data`."""

    job_id: str
    assignment_id: str
    build_id: str
    offset: NonNegInt64
    data: str

    def __post_init__(self) -> None:
        # Checked in bytes, as the wire carries it; raising here makes it a ValidationError.
        if len(self.data) * 4 > MAX_LOG_PIECE_BYTES and len(self.data.encode()) > MAX_LOG_PIECE_BYTES:
            raise ValueError(f"data is larger than {MAX_LOG_PIECE_BYTES} bytes")


class QueryKnownDerivations(Message):
    """Which of these derivations does the server hold with their whole input closure? Answered with
    KnownDerivations, on the worker's open evaluation assignment (any other: an empty answer)."""

    job_id: str
    assignment_id: str
    drv_paths: Annotated[list[str], Meta(max_length=MAX_KNOWN_QUERY_PATHS)]


class Draining(Message):
    """Worker -> server: assign me nothing more. Server -> worker: the server is draining."""


# Server -> worker


class InitAck(Message):
    worker_id: str
    protocol: int
    authorized_projects: list[str]


class Reject(Message):
    code: int
    reason: str


class Error(Message):
    code: int
    message: str


class JobListChunk(Message):
    candidates: Annotated[list[JobCandidate], Meta(max_length=MAX_CANDIDATES_PER_FRAME)]
    is_final: bool


class JobOffer(Message):
    candidates: Annotated[list[JobCandidate], Meta(max_length=MAX_CANDIDATES_PER_FRAME)]


class AssignJob(Message):
    job_id: str
    assignment_id: str
    job: Job
    cluster: ClusterMembership | None = None


class AbortJob(Message):
    job_id: str
    assignment_id: str
    reason: str


class StartCluster(Message):
    attempt: str
    roster: list[ClusterPeer]


class AbortCluster(Message):
    attempt: str
    reason: str


class KnownDerivations(Message):
    """The answer to one QueryKnownDerivations: those of its paths the server knows."""

    job_id: str
    assignment_id: str
    drv_paths: list[str]


class ClusterSignalDelivery(Message, tag="ClusterSignal"):
    """Server -> worker ClusterSignal: a member's signal, forwarded with its sender's address."""

    attempt: str
    from_: ClusterAddress = msgspec.field(name="from")
    payload: str


WorkerMessage: TypeAlias = (
    InitConnection
    | WorkerCapabilities
    | WorkerMetrics
    | RequestJobList
    | RequestJobChunk
    | RequestJob
    | AssignJobResponse
    | JobUpdate
    | JobCompleted
    | JobFailed
    | BuildProgress
    | EvalProgress
    | ClusterSignal
    | BuildLog
    | QueryKnownDerivations
    | Draining
)
"""Every message a worker may send."""

ServerMessage: TypeAlias = (
    InitAck
    | Reject
    | Error
    | JobListChunk
    | JobOffer
    | AssignJob
    | AbortJob
    | StartCluster
    | AbortCluster
    | ClusterSignalDelivery
    | KnownDerivations
    | Draining
)
"""Every message the server may send."""

ReportMessage: TypeAlias = JobUpdate | JobCompleted | JobFailed | BuildProgress | EvalProgress | BuildLog
"""Reports echo an assignment_id; one that is not the job's open assignment on this worker is dropped."""

WORKER_MESSAGE_TYPES: Final[tuple[type[Message], ...]] = (
    InitConnection,
    WorkerCapabilities,
    WorkerMetrics,
    RequestJobList,
    RequestJobChunk,
    RequestJob,
    AssignJobResponse,
    JobUpdate,
    JobCompleted,
    JobFailed,
    BuildProgress,
    EvalProgress,
    ClusterSignal,
    BuildLog,
    QueryKnownDerivations,
    Draining,
)
SERVER_MESSAGE_TYPES: Final[tuple[type[Message], ...]] = (
    InitAck,
    Reject,
    Error,
    JobListChunk,
    JobOffer,
    AssignJob,
    AbortJob,
    StartCluster,
    AbortCluster,
    ClusterSignalDelivery,
    KnownDerivations,
    Draining,
)

_worker_decoder: msgspec.json.Decoder[WorkerMessage] = msgspec.json.Decoder(WorkerMessage)
_server_decoder: msgspec.json.Decoder[ServerMessage] = msgspec.json.Decoder(ServerMessage)
_encoder = msgspec.json.Encoder()


def frame_too_large(frame: str | bytes) -> bool:
    """True when the frame is over MAX_FRAME_BYTES in UTF-8 (checked without encoding when possible)."""
    if isinstance(frame, bytes):
        return len(frame) > MAX_FRAME_BYTES
    if len(frame) > MAX_FRAME_BYTES:
        return True
    if len(frame) * 4 <= MAX_FRAME_BYTES:
        return False
    return len(frame.encode()) > MAX_FRAME_BYTES


REPLACEMENT_CHARACTER: Final = "\ufffd"
"""What a NUL or a lone surrogate of any decoded string becomes."""

# An escape that may spell NUL or a surrogate (`\u0000`, `\ud800`..`\udfff`, any case). A match may be
# no escape at all (`\\u0000` is a backslash and the text "u0000"): it only sends the frame the slow way.
_SUSPECT_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})")
_SUSPECT_ESCAPE_BYTES = re.compile(rb"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})")
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """`text` with every NUL and every lone surrogate replaced by U+FFFD (a surrogate pair given as two
    code points becomes the character it spells)."""
    if "\x00" in text:
        text = text.replace("\x00", REPLACEMENT_CHARACTER)
    if _SURROGATE.search(text):
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text


def _clean(value: object) -> object:
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(k) if isinstance(k, str) else k: _clean(v) for k, v in value.items()}
    return value


def _cleaned_frame(frame: str | bytes) -> str | bytes:
    """The frame with its text made storable (see the module's docstring). Most frames hold no escape of
    NUL or a surrogate and no raw surrogate, and pass unchanged. The others are parsed by the standard
    library's json (which, unlike msgspec, accepts a lone surrogate escape), cleaned, and written again
    for the strict decoder, so what is a violation stays one."""
    if isinstance(frame, str):
        # ASCII holds no raw surrogate, and a frame without a backslash-u no escape: two scans in C for
        # nearly every frame (the regular expressions' scans were a twentieth of the event loop's time).
        if not frame.isascii() and _SURROGATE.search(frame) is not None:
            frame = clean_text(frame)
        if "\\u" not in frame or not _SUSPECT_ESCAPE.search(frame):
            return frame
    elif not _SUSPECT_ESCAPE_BYTES.search(frame):
        return frame
    try:
        parsed = json.loads(frame)
    except (ValueError, RecursionError):
        return frame  # not JSON (or absurdly deep): the strict decoder says why
    return json.dumps(_clean(parsed), ensure_ascii=False, allow_nan=True)


def _decode(decoder: msgspec.json.Decoder[object], frame: str | bytes) -> object:
    if frame_too_large(frame):
        raise ProtocolError(f"frame is larger than {MAX_FRAME_BYTES} bytes")
    try:
        return decoder.decode(_cleaned_frame(frame))
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
        raise ProtocolError(str(exc)) from None


def decode_worker_message(frame: str | bytes) -> WorkerMessage:
    """Decode one worker -> server frame strictly, or raise ProtocolError."""
    return _decode(_worker_decoder, frame)  # type: ignore[arg-type,return-value]


def decode_server_message(frame: str | bytes) -> ServerMessage:
    """Decode one server -> worker frame strictly (the reference worker's side), or raise ProtocolError."""
    return _decode(_server_decoder, frame)  # type: ignore[arg-type,return-value]


def encode(message: Message) -> str:
    """The JSON text frame of a message (either direction)."""
    return _encoder.encode(message).decode()


def tag_of(message_type: type[msgspec.Struct]) -> str:
    """The tag a tagged struct is sent with: a message's `type`, a JobUpdateKind's `kind`, ..."""
    tag = message_type.__struct_config__.tag
    assert isinstance(tag, str)
    return tag
