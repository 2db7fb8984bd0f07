"""The operator intents of gradient.control.v2 (prioritize, rebuild, drain_worker, deactivate_worker):
control entries under their own schema name, decoded strictly, and folded without touching the desired
state, the outcome or the submissions, wherever they land in a history."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.records.decisions.fold import Effect, fold
from gradient.records.errors import SchemaError, UnknownNameError
from gradient.records.schemas import (
    OPERATOR_INTENTS,
    OPERATOR_SCHEMA,
    DeactivateWorker,
    DrainWorker,
    OperatorIntent,
    Prioritize,
    Rebuild,
    decode_body,
    encode,
    schema_for,
)
from gradient.records.timeline import describe
from tests.support.records import T0, History, entry, histories

KEY = "build:" + "0" * 8 + "-0000-4000-8000-" + "0" * 12

operator_intents: st.SearchStrategy[OperatorIntent] = st.one_of(
    st.builds(Prioritize, target=st.just(KEY), reason=st.text(max_size=10)),
    st.builds(Rebuild, build=st.just(KEY), reason=st.text(max_size=10)),
    st.builds(DrainWorker, worker=st.text(min_size=1, max_size=10)),
    st.builds(DeactivateWorker, worker=st.text(min_size=1, max_size=10)),
)


@given(operator_intents)
def test_an_operator_intent_is_a_v2_control_entry_that_round_trips(intent: OperatorIntent) -> None:
    kind, schema = schema_for(intent)
    assert (kind.value, schema) == ("control", OPERATOR_SCHEMA)
    assert decode_body(schema, encode(intent)) == intent
    assert describe(intent).endswith(("requested for " + KEY, intent.reason)) or "worker" in describe(intent)


def test_v2_decoding_is_strict() -> None:
    with pytest.raises(UnknownNameError):
        decode_body(OPERATOR_SCHEMA, '{"intent": "cancel"}')  # a v1 intent is not a v2 one
    with pytest.raises(SchemaError):
        decode_body(OPERATOR_SCHEMA, json.dumps({"intent": "rebuild", "build": KEY, "extra": 1}))
    with pytest.raises(SchemaError):
        decode_body(OPERATOR_SCHEMA, '{"intent": "rebuild"}')
    assert len(OPERATOR_INTENTS) == 4


@given(
    histories(), st.lists(operator_intents, min_size=1, max_size=4), st.sampled_from(["admin:alice", "bob"])
)
def test_operator_intents_change_neither_the_desired_state_nor_the_outcome(
    generated: History, intents: list[OperatorIntent], operator: str
) -> None:
    header, history = generated
    before = fold(header, history, T0)
    tail = [entry(len(history) + n, i, actor=operator) for n, i in enumerate(intents, start=1)]
    after = fold(header, (*history, *tail), T0)
    assert (after.desired, after.outcome, after.cause) == (before.desired, before.outcome, before.cause)
    assert after.submissions == before.submissions and after.holds == before.holds
    assert after.pending_requeue == before.pending_requeue and after.settled == before.settled
    added = after.controls[len(before.controls) :]
    assert [(c.intent, c.actor) for c in added] == [
        (type(i).__struct_config__.tag, operator) for i in intents
    ]
    for control, intent in zip(added, intents, strict=True):
        if isinstance(intent, Prioritize):
            expected = Effect.PRIORITIZE_IGNORED if before.has_outcome else Effect.PRIORITIZED
            assert control.effect is expected
