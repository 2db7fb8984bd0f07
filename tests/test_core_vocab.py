"""The shared core: each enum defined once (and the models' choices the ones TextChoices gave), one job
key type that formats and parses every key, one parse_uuid."""

from __future__ import annotations

import ast
import enum
import inspect
import pathlib
import uuid

import pytest
from django.db import models
from hypothesis import given
from hypothesis import strategies as st

from gradient.clusters import models as cluster_models
from gradient.clusters.decisions import settlement
from gradient.clusters.decisions import types as cluster_types
from gradient.core import jobkey, protocol, vocab
from gradient.core.ids import parse_uuid
from gradient.core.jobkey import RECORD_KEYS, SINGLE_JOB_KEYS, JobKey, JobKeyError
from gradient.core.vocab import JobKeyKind, JobKind, RecordKind
from gradient.records import models as record_models
from gradient.records import schemas
from gradient.scheduling import models as scheduling_models
from gradient.workers import models as worker_models

ROOT = pathlib.Path(__file__).resolve().parent.parent / "gradient"
VOCAB_ENUMS = [
    obj
    for obj in vars(vocab).values()
    if inspect.isclass(obj) and issubclass(obj, enum.StrEnum) and obj.__module__ == vocab.__name__
]


# --- One definition ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", VOCAB_ENUMS, ids=lambda c: c.__name__)
def test_choices_are_the_pairs_text_choices_gave(cls: type[enum.StrEnum]) -> None:
    given_labels = {"JobKind": {"EVAL": "Evaluation"}}.get(cls.__name__, {})
    as_text_choices = models.TextChoices(
        cls.__name__,
        [(m.name, (m.value, given_labels[m.name]) if m.name in given_labels else m.value) for m in cls],
    )
    assert vocab.choices(cls) == as_text_choices.choices


def test_old_names_are_the_vocabulary_itself() -> None:
    same = [
        (
            vocab.FailureKind,
            scheduling_models.BuildFailureKind,
            protocol.BuildFailureKind,
            cluster_types.FailureKind,
        ),
        (vocab.JobKind, scheduling_models.JobKind, cluster_types.SlotKind),
        (vocab.EvaluationStatus, scheduling_models.EvaluationStatus),
        (vocab.BuildStatus, scheduling_models.BuildStatus),
        (vocab.DispatchOutcome, scheduling_models.DispatchOutcome, schemas.AssignmentOutcome),
        (vocab.ClusterStatus, cluster_models.ClusterStatus, cluster_types.ClusterStatus),
        (
            vocab.AttemptOutcome,
            cluster_models.AttemptOutcome,
            cluster_types.AttemptOutcome,
            schemas.AttemptOutcome,
        ),
        (vocab.Verdict, cluster_models.Verdict, settlement.Verdict, schemas.Verdict),
        (vocab.SeatResult, cluster_models.SeatResult, settlement.MemberOutcome),
        (vocab.EntryKind, record_models.EntryKind, schemas.EntryKind),
        (vocab.RecordKind, schemas.JobKind),
        (vocab.EVALUATION_TERMINAL, scheduling_models.EVALUATION_TERMINAL),
        (vocab.CLUSTER_TERMINAL, cluster_models.CLUSTER_TERMINAL),
    ]
    for group in same:
        assert all(other is group[0] for other in group[1:]), group


def test_the_models_take_their_choices_from_the_vocabulary() -> None:
    fields = {
        (scheduling_models.Evaluation, "status"): vocab.EvaluationStatus,
        (scheduling_models.Evaluation, "kind"): vocab.EvaluationKind,
        (scheduling_models.DerivationBuild, "status"): vocab.BuildStatus,
        (scheduling_models.DerivationBuild, "failure_kind"): vocab.FailureKind,
        (scheduling_models.DispatchedJob, "kind"): vocab.JobKind,
        (scheduling_models.DispatchedJob, "outcome"): vocab.DispatchOutcome,
        (cluster_models.ClusterJob, "status"): vocab.ClusterStatus,
        (cluster_models.ClusterAttempt, "outcome"): vocab.AttemptOutcome,
        (cluster_models.ClusterAttempt, "verdict"): vocab.Verdict,
        (cluster_models.ClusterSeat, "result"): vocab.SeatResult,
        (record_models.RecordEntry, "kind"): vocab.EntryKind,
        (worker_models.IdleSlot, "kind"): vocab.JobKind,
    }
    for (model, name), cls in fields.items():
        assert model._meta.get_field(name).choices == vocab.choices(cls), (model, name)


def _enum_classes() -> list[tuple[pathlib.Path, ast.ClassDef]]:
    found = []
    for path in ROOT.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b).endswith(("Enum", "Choices")) for b in node.bases
            ):
                found.append((path, node))
    return found


def test_no_enum_outside_the_vocabulary_copies_one_of_it() -> None:
    """No TextChoices left, and no enum elsewhere with a vocabulary enum's name or values."""
    names = {cls.__name__ for cls in VOCAB_ENUMS}
    value_sets = {frozenset(m.value for m in cls): cls.__name__ for cls in VOCAB_ENUMS}
    for path, node in _enum_classes():
        if path.name == "vocab.py" and path.parent.name == "core":
            continue
        where = f"{path.relative_to(ROOT)}: {node.name}"
        assert not any(ast.unparse(b).endswith("Choices") for b in node.bases), where
        assert node.name not in names, where
        values = frozenset(
            s.value.value
            for s in node.body
            if isinstance(s, ast.Assign)
            and isinstance(s.value, ast.Constant)
            and isinstance(s.value.value, str)
        )
        assert values not in value_sets, f"{where} has the values of vocab.{value_sets.get(values)}"


def test_the_core_imports_no_django_and_no_app() -> None:
    for path in (ROOT / "core").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for module in modules:
                assert not module.startswith("django"), (path.name, module)
                assert not module.startswith("gradient.") or module.startswith("gradient.core"), (
                    path.name,
                    module,
                )


# --- Helpers -------------------------------------------------------------------------------------------


def test_member_of_and_values() -> None:
    assert vocab.member_of(vocab.BuildStatus, "Queued") is vocab.BuildStatus.QUEUED
    for bad in ("queued", "", None, 3, b"Queued"):
        assert vocab.member_of(vocab.BuildStatus, bad) is None
    assert vocab.values(vocab.JobKind) == ("eval", "build")
    assert vocab.values(vocab.AttemptOutcome) == ("Succeeded", "Failed", "PrepareFailed", "Aborted")


def test_the_protocol_calls_an_evaluation_job_flake() -> None:
    assert vocab.job_kind_of("flake") is JobKind.EVAL
    assert vocab.job_kind_of("build") is JobKind.BUILD
    for kind in JobKind:
        assert vocab.job_kind_of(vocab.protocol_kind_name(kind)) is kind


def test_failed_reports_decode_their_kind_as_the_vocabulary() -> None:
    frame = (
        b'{"type":"JobFailed","job_id":"build:1","assignment_id":"a","error":"e",'
        b'"kind":"substitute_unavailable","elapsed_ms":1}'
    )
    message = protocol.decode_worker_message(frame)
    assert isinstance(message, protocol.JobFailed)
    assert message.kind is vocab.FailureKind.SUBSTITUTE_UNAVAILABLE


# --- Job keys ------------------------------------------------------------------------------------------


@given(st.sampled_from(list(JobKeyKind)), st.uuids())
def test_job_keys_round_trip(kind: JobKeyKind, job_id: uuid.UUID) -> None:
    key = JobKey.of(kind, job_id)
    text = str(key)
    assert text == f"{kind.value}:{job_id}"
    assert JobKey.parse(text) == key
    assert JobKey.parse(text, canonical=True) == key
    assert JobKey.require(text) == key
    assert jobkey.job_key(kind, str(job_id)) == text


@given(st.uuids())
def test_the_three_formats(job_id: uuid.UUID) -> None:
    assert jobkey.eval_key(job_id) == f"eval:{job_id}" == jobkey.eval_key(str(job_id).upper())
    assert jobkey.build_key(job_id) == f"build:{job_id}" == scheduling_models.build_key(job_id)
    assert jobkey.cluster_key(job_id) == f"cluster:{job_id}"
    assert JobKey.of(JobKind.BUILD, job_id) == JobKey(JobKeyKind.BUILD, job_id)
    assert JobKey.of(RecordKind.EVALUATION, job_id) == JobKey(JobKeyKind.EVAL, job_id)
    assert JobKey.of(RecordKind.CLUSTER, job_id) == JobKey(JobKeyKind.CLUSTER, job_id)


def test_kinds_of_a_key() -> None:
    job_id = uuid.uuid4()
    assert JobKey(JobKeyKind.EVAL, job_id).job_kind is JobKind.EVAL
    assert JobKey(JobKeyKind.EVAL, job_id).record_kind is RecordKind.EVALUATION
    assert JobKey(JobKeyKind.BUILD, job_id).job_kind is JobKind.BUILD
    assert JobKey(JobKeyKind.BUILD, job_id).record_kind is None
    assert JobKey(JobKeyKind.CLUSTER, job_id).job_kind is None
    assert JobKey(JobKeyKind.CLUSTER, job_id).record_kind is RecordKind.CLUSTER
    assert JobKeyKind.BUILD.prefix == "build:"


MALFORMED = [
    None,
    7,
    b"eval:x",
    "",
    "eval",
    "eval:",
    "eval:x",
    ":" + str(uuid.UUID(int=1)),
    "pipeline:1",
    "EVAL:1",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_key_parses_to_none_and_require_says_why(text: object) -> None:
    assert JobKey.parse(text) is None
    with pytest.raises(JobKeyError, match="is not a job key"):
        JobKey.require(text)


def test_kinds_and_canonical_form_narrow_what_parses() -> None:
    job_id = uuid.uuid4()
    assert JobKey.parse(f"cluster:{job_id}", kinds=SINGLE_JOB_KEYS) is None
    assert JobKey.parse(f"build:{job_id}", kinds=RECORD_KEYS) is None
    upper = f"eval:{str(job_id).upper()}"
    assert JobKey.parse(upper) == JobKey(JobKeyKind.EVAL, job_id)
    assert JobKey.parse(upper, canonical=True) is None
    assert JobKey.parse(f"eval:{job_id.hex}", canonical=True) is None
    with pytest.raises(JobKeyError, match="eval:<uuid> or cluster:<uuid>"):
        JobKey.require(f"build:{job_id}", kinds=RECORD_KEYS)


# --- Ids -----------------------------------------------------------------------------------------------


def test_parse_uuid_never_raises() -> None:
    job_id = uuid.uuid4()
    assert parse_uuid(job_id) is job_id
    assert parse_uuid(str(job_id)) == job_id
    assert parse_uuid(job_id.hex) == job_id
    for bad in (None, "", "x", 12, 1.5, b"\x00", object(), [str(job_id)]):
        assert parse_uuid(bad) is None


def test_parse_uuid_reads_a_string_again_from_memory_and_forgets_past_its_bound() -> None:
    from gradient.core import ids

    job_id = uuid.uuid4()
    first = parse_uuid(str(job_id))
    assert parse_uuid(str(job_id)) is first  # the same string again: no second parse
    assert parse_uuid(str(job_id).upper()) == job_id  # another spelling: its own entry, the same uuid
    assert parse_uuid("not-a-uuid") is None and parse_uuid("not-a-uuid") is None  # refusals are not kept
    for _ in range(ids._PARSED_MAX + 1):
        parse_uuid(str(uuid.uuid4()))
    assert len(ids._PARSED) <= ids._PARSED_MAX
    assert parse_uuid(str(job_id)) == job_id
