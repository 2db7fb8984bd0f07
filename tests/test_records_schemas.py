"""Strict decoding of headers, control intents and facts: whatever this build does not know is refused
with its own error class, never skipped. Generated over every entry a writer can produce."""

from __future__ import annotations

import enum
import json
import uuid

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gradient.records.errors import SchemaError, UnknownNameError
from gradient.records.schemas import (
    CONTROL_INTENTS,
    CONTROL_SCHEMA,
    FACT_SCHEMA,
    FACT_TYPES,
    HEADER_SCHEMA,
    AssignmentClosed,
    AssignmentOutcome,
    AttemptOutcome,
    CallDeadline,
    CallKind,
    Cancel,
    ClusterAttemptClosed,
    JobKind,
    ObjectRef,
    ObjectTable,
    Outcome,
    OutcomeCommitted,
    RawEntry,
    ReportKind,
    RowStatus,
    StatusChanged,
    Verdict,
    WorkerReport,
    decode_body,
    decode_header,
    encode,
    intent_names,
    job_key_for,
    parse_job_key,
    spec_digest,
)
from tests.support.records import T0, History, histories, make_header

KNOWN_SCHEMAS = {HEADER_SCHEMA, CONTROL_SCHEMA, FACT_SCHEMA}
_name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.0123456789", min_size=1, max_size=20)


def _fields_of(body: dict[str, object]) -> set[str]:
    tag = body.get("intent", body.get("fact"))
    for struct in (*CONTROL_INTENTS, *FACT_TYPES):
        if struct.__struct_config__.tag == tag:
            return set(struct.__struct_fields__)
    raise AssertionError(tag)


def _an_entry(generated: History, data: st.DataObject) -> RawEntry:
    _, history = generated
    assume(history)
    return data.draw(st.sampled_from(history))


@given(histories(), st.data())
def test_every_entry_a_writer_produces_decodes_and_reencodes_to_the_same_bytes(
    generated: History, data: st.DataObject
) -> None:
    e = _an_entry(generated, data)
    assert encode(decode_body(e.schema, e.body)) == e.body


@given(histories(), st.data(), _name)
def test_an_unknown_field_is_refused_as_a_schema_error(
    generated: History, data: st.DataObject, field: str
) -> None:
    e = _an_entry(generated, data)
    body = json.loads(e.body)
    assume(field not in _fields_of(body) and field not in ("intent", "fact"))
    body[field] = data.draw(st.none() | st.integers() | st.text(max_size=5))
    with pytest.raises(SchemaError):
        decode_body(e.schema, json.dumps(body))


@given(histories(), st.data(), st.text(min_size=1, max_size=8))
def test_trailing_data_after_the_body_is_refused_as_a_schema_error(
    generated: History, data: st.DataObject, trailing: str
) -> None:
    assume(trailing.strip(" \t\r\n"))  # JSON whitespace is not data
    e = _an_entry(generated, data)
    with pytest.raises(SchemaError):
        decode_body(e.schema, e.body + trailing)


@given(histories(), st.data(), _name)
def test_an_unknown_intent_or_fact_name_is_refused_as_an_unknown_name(
    generated: History, data: st.DataObject, name: str
) -> None:
    e = _an_entry(generated, data)
    body = json.loads(e.body)
    tag_field = "intent" if "intent" in body else "fact"
    known = {str(t.__struct_config__.tag) for t in (*CONTROL_INTENTS, *FACT_TYPES)}
    assume(name not in known)
    body[tag_field] = name
    with pytest.raises(UnknownNameError):
        decode_body(e.schema, json.dumps(body))


_A = uuid.UUID(int=1)
_REF = ObjectRef(table=ObjectTable.CLUSTER_ATTEMPT, id=_A)
# Every enum-typed field of every fact: (a body, the path to the field, the enum it holds).
ENUM_FIELDS: list[tuple[str, tuple[str, ...], type[enum.Enum]]] = [
    (
        encode(AssignmentClosed(assignment_id=_A, outcome=AssignmentOutcome.FAILED)),
        ("outcome",),
        AssignmentOutcome,
    ),
    (
        encode(
            ClusterAttemptClosed(cluster_attempt_id=_A, outcome=AttemptOutcome.FAILED, verdict=Verdict.RETRY)
        ),
        ("outcome",),
        AttemptOutcome,
    ),
    (
        encode(
            ClusterAttemptClosed(cluster_attempt_id=_A, outcome=AttemptOutcome.FAILED, verdict=Verdict.RETRY)
        ),
        ("verdict",),
        Verdict,
    ),
    (encode(CallDeadline(call=CallKind.HOLD, object=_REF, deadline=T0)), ("call",), CallKind),
    (encode(CallDeadline(call=CallKind.HOLD, object=_REF, deadline=T0)), ("object", "table"), ObjectTable),
    (encode(WorkerReport(assignment_id=_A, worker="w", kind=ReportKind.UPDATE)), ("kind",), ReportKind),
    (encode(StatusChanged(status=RowStatus.BUILDING)), ("status",), RowStatus),
    (encode(OutcomeCommitted(outcome=Outcome.FAILED)), ("outcome",), Outcome),
]


@given(st.sampled_from(ENUM_FIELDS), _name)
def test_an_unknown_enum_name_is_refused_as_an_unknown_name(
    case: tuple[str, tuple[str, ...], type[enum.Enum]], name: str
) -> None:
    text, path, names = case
    assume(name not in {member.value for member in names})
    body = json.loads(text)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = name
    with pytest.raises(UnknownNameError):
        decode_body(FACT_SCHEMA, json.dumps(body))


@given(histories(), st.data(), _name)
def test_an_unknown_schema_name_is_refused_as_a_schema_error(
    generated: History, data: st.DataObject, schema: str
) -> None:
    assume(schema not in KNOWN_SCHEMAS)
    e = _an_entry(generated, data)
    with pytest.raises(SchemaError):
        decode_body(schema, e.body)
    with pytest.raises(SchemaError):
        decode_header(encode(make_header()), schema=schema)


def test_a_missing_field_or_a_wrong_type_is_a_schema_error() -> None:
    with pytest.raises(SchemaError):
        decode_body(FACT_SCHEMA, '{"fact":"assignment_closed","outcome":"Completed"}')
    with pytest.raises(SchemaError):
        decode_body(CONTROL_SCHEMA, '{"intent":"cancel","reason":7}')
    with pytest.raises(SchemaError):
        decode_body(CONTROL_SCHEMA, "not json")


def test_a_fact_is_not_a_control_intent_and_a_control_intent_is_not_a_fact() -> None:
    with pytest.raises(SchemaError):  # no `fact` tag at all
        decode_body(FACT_SCHEMA, encode(Cancel()))
    with pytest.raises(SchemaError):
        decode_body(CONTROL_SCHEMA, '{"fact":"settled"}')


@given(st.sampled_from(intent_names()), st.text(max_size=30))
def test_an_older_build_reads_control_intents_without_knowing_any_fact(intent: str, reason: str) -> None:
    # control intents decode through the frozen control schema alone
    decoded = decode_body(CONTROL_SCHEMA, json.dumps({"intent": intent, "reason": reason}))
    assert decoded.reason == reason


def test_the_header_decodes_strictly_too() -> None:
    header = make_header()
    text = encode(header)
    assert decode_header(text) == header
    with pytest.raises(SchemaError):
        decode_header(text[:-1] + ',"owner":"x"}')
    with pytest.raises(UnknownNameError):
        decode_header(text.replace('"kind":"evaluation"', '"kind":"pipeline"'))


@given(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=6))
def test_the_spec_digest_is_the_same_whatever_the_key_order(spec: dict[str, object]) -> None:
    reordered = dict(reversed(list(spec.items())))
    assert spec_digest(spec) == spec_digest(reordered)
    assert spec_digest(spec).startswith("sha256:")


def test_a_spec_struct_and_its_dict_have_the_same_digest() -> None:
    class Spec(msgspec.Struct):
        project: str
        commit: str

    assert spec_digest(Spec(project="p", commit="c")) == spec_digest({"commit": "c", "project": "p"})


@given(st.sampled_from(list(JobKind)), st.uuids())
def test_job_keys_round_trip_and_anything_else_is_refused(kind: JobKind, job_id: uuid.UUID) -> None:
    assert parse_job_key(job_key_for(kind, job_id)) == (kind, job_id)
    for bad in (f"build:{job_id}", f"eval:{job_id}x", str(job_id), f"EVAL:{job_id}"):
        with pytest.raises(SchemaError):
            parse_job_key(bad)
