"""The protocol's typed messages: every message and shape as the spec names it, strict decoding, and
frames that round-trip."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradient.core import protocol as p

SAMPLES_FROM_WORKER: list[p.Message] = [
    p.InitConnection(
        worker_id="w",
        token="t",
        capabilities=p.InitCapabilities(fetch=True, eval=False, build=True),
        protocol=1,
    ),
    p.WorkerCapabilities(
        architectures=["x86_64-linux"],
        system_features=["kvm"],
        max_concurrent_builds=2,
        cpu_count=8,
        ram_total_mb=16000,
        cpu_core_score=900,
        zone="z",
        endpoint="e",
    ),
    p.WorkerMetrics(cpu_usage_pct=3.5, ram_free_mb=100),
    p.RequestJobList(),
    p.RequestJobChunk(
        scores=[
            p.CandidateScore(job_id="build:1", missing_count=1, missing_nar_size=2, outputs_present=False)
        ],
        is_final=True,
    ),
    p.RequestJob(kind="flake"),
    p.AssignJobResponse(job_id="j", assignment_id="a", accepted=False, reason="full"),
    p.JobUpdate(
        job_id="j",
        assignment_id="a",
        update=p.EvalResult(
            derivations=[
                p.DiscoveredDerivation(
                    drv_path="/nix/store/x.drv",
                    attr="packages.x86_64-linux.x",
                    system="x86_64-linux",
                    required_features=[],
                    outputs=[p.OutputPath(name="out", path="/nix/store/x")],
                    input_drvs=[],
                    cached_outputs=[p.CachedOutput(path="/nix/store/x", nar_size=5)],
                )
            ],
            warnings=["w"],
            errors=[],
        ),
    ),
    p.JobUpdate(
        job_id="j",
        assignment_id="a",
        update=p.BuildOutput(
            build_id="b",
            outputs=[p.BuiltOutput(name="out", path="/nix/store/x", nar_size=1)],
            substituted=True,
        ),
    ),
    p.JobCompleted(job_id="j", assignment_id="a", elapsed_ms=10),
    p.JobFailed(
        job_id="j",
        assignment_id="a",
        error="e",
        kind=p.BuildFailureKind.INPUTS_UNAVAILABLE,
        elapsed_ms=1,
        missing_paths=["/nix/store/y"],
    ),
    p.BuildProgress(job_id="j", assignment_id="a", build_id="b", phase="upload", bytes_done=1, bytes_total=2),
    p.EvalProgress(job_id="j", assignment_id="a", phase="evaluating", done=3),
    p.ClusterSignal(attempt="t", payload="hi", to=p.ClusterAddress(role="server", index=0)),
    p.BuildLog(job_id="j", assignment_id="a", build_id="b", offset=0, data="hello\n"),
    p.QueryKnownDerivations(job_id="j", assignment_id="a", drv_paths=["/nix/store/x.drv"]),
    p.JobUpdate(
        job_id="j",
        assignment_id="a",
        update=p.EvalResult(
            derivations=[], warnings=[], errors=[], is_final=False, known_drvs=["/nix/store/x.drv"]
        ),
    ),
    p.Draining(),
]

SAMPLES_FROM_SERVER: list[p.Message] = [
    p.InitAck(worker_id="w", protocol=1, authorized_projects=["a"]),
    p.Reject(code=496, reason="r"),
    p.Error(code=400, message="m"),
    p.JobListChunk(
        candidates=[
            p.JobCandidate(
                job_id="build:1",
                kind="build",
                required_paths=[p.RequiredPath(path="/nix/store/a", nar_size=None)],
                drv_paths=["/nix/store/b.drv"],
                output_paths=["/nix/store/b"],
                requirement=p.BuildRequirement(architecture="builtin", required_features=[]),
            )
        ],
        is_final=False,
    ),
    p.JobOffer(candidates=[]),
    p.AssignJob(
        job_id="eval:1",
        assignment_id="a",
        job=p.FlakeJob(
            steps=["EvaluateFlake", "EvaluateDerivations"],
            source=p.CachedSource(store_path="/nix/store/s"),
            wildcards=["*"],
            timeout_secs=60,
        ),
        cluster=p.ClusterMembership(attempt="t", role="r", index=1, hold_secs=40),
    ),
    p.AssignJob(
        job_id="build:1",
        assignment_id="a",
        job=p.BuildJob(
            builds=[
                p.BuildSpec(
                    build_id="b",
                    drv_path="/nix/store/b.drv",
                    outputs=[p.OutputPath(name="out", path="/nix/store/b")],
                    timeout_secs=1,
                    max_silent_secs=1,
                )
            ],
            requirement=p.BuildRequirement(architecture="x86_64-linux", required_features=["kvm"]),
        ),
    ),
    p.AbortJob(job_id="j", assignment_id="a", reason="r"),
    p.StartCluster(attempt="t", roster=[p.ClusterPeer(role="r", index=0, worker_id="w", zone=None)]),
    p.AbortCluster(attempt="t", reason="r"),
    p.KnownDerivations(job_id="j", assignment_id="a", drv_paths=["/nix/store/x.drv"]),
    p.ClusterSignalDelivery(attempt="t", from_=p.ClusterAddress(role="r", index=0), payload="x"),
    p.Draining(),
]


def test_every_message_of_the_spec_has_a_struct_in_its_direction() -> None:
    assert {p.tag_of(t) for t in p.WORKER_MESSAGE_TYPES} == {
        "InitConnection",
        "WorkerCapabilities",
        "WorkerMetrics",
        "RequestJobList",
        "RequestJobChunk",
        "RequestJob",
        "AssignJobResponse",
        "JobUpdate",
        "JobCompleted",
        "JobFailed",
        "BuildProgress",
        "EvalProgress",
        "ClusterSignal",
        "BuildLog",
        "QueryKnownDerivations",
        "Draining",
    }
    assert {p.tag_of(t) for t in p.SERVER_MESSAGE_TYPES} == {
        "InitAck",
        "Reject",
        "Error",
        "JobListChunk",
        "JobOffer",
        "AssignJob",
        "AbortJob",
        "StartCluster",
        "AbortCluster",
        "ClusterSignal",
        "KnownDerivations",
        "Draining",
    }
    assert {type(m) for m in SAMPLES_FROM_WORKER} == set(p.WORKER_MESSAGE_TYPES)
    assert {type(m) for m in SAMPLES_FROM_SERVER} == set(p.SERVER_MESSAGE_TYPES)


@pytest.mark.parametrize("message", SAMPLES_FROM_WORKER, ids=lambda m: p.tag_of(type(m)))
def test_worker_messages_round_trip_with_type_and_snake_case_fields_at_the_top(message: p.Message) -> None:
    frame = p.encode(message)
    assert p.decode_worker_message(frame) == message
    assert json.loads(frame)["type"] == p.tag_of(type(message))


@pytest.mark.parametrize("message", SAMPLES_FROM_SERVER, ids=lambda m: p.tag_of(type(m)))
def test_server_messages_round_trip(message: p.Message) -> None:
    assert p.decode_server_message(p.encode(message)) == message


def test_the_server_to_worker_cluster_signal_names_its_sender_in_from() -> None:
    frame = json.loads(p.encode(SAMPLES_FROM_SERVER[-2]))
    assert frame == {
        "type": "ClusterSignal",
        "attempt": "t",
        "from": {"role": "r", "index": 0},
        "payload": "x",
    }


def test_shapes_are_tagged_by_kind_as_the_spec_says() -> None:
    assign = json.loads(p.encode(SAMPLES_FROM_SERVER[5]))
    assert assign["job"]["kind"] == "flake" and assign["job"]["source"] == {
        "kind": "cached",
        "store_path": "/nix/store/s",
    }
    update = json.loads(p.encode(SAMPLES_FROM_WORKER[8]))
    assert update["update"]["kind"] == "build_output"


@pytest.mark.parametrize(
    "frame",
    [
        '{"type": "InitAck", "worker_id": "w", "protocol": 1, "authorized_projects": []}',
        '{"type": "RequestJob", "kind": "flake", "extra": null}',
        '{"type": "JobFailed", "job_id": "j", "assignment_id": "a", "error": "e", "kind": "oops", '
        '"elapsed_ms": 1}',
        '{"type": "ClusterSignal", "attempt": "t", "payload": "x", "from": {"role": "r", "index": 0}}',
        '{"type": "WorkerMetrics", "cpu_usage_pct": -1}',
        '{"type": "RequestJobChunk", "scores": [], "is_final": 1}',
        "",
    ],
)
def test_the_worker_decoder_is_strict(frame: str) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode_worker_message(frame)


def test_optional_fields_may_be_omitted_or_null() -> None:
    omitted = p.decode_worker_message(
        '{"type": "AssignJobResponse", "job_id": "j", "assignment_id": "a", "accepted": true}'
    )
    null = p.decode_worker_message(
        '{"type": "AssignJobResponse", "job_id": "j", "assignment_id": "a", "accepted": true, "reason": null}'
    )
    assert omitted == null


def test_a_signal_payload_is_at_most_64_kib() -> None:
    at_limit = p.ClusterSignal(attempt="t", payload="x" * p.MAX_SIGNAL_PAYLOAD_BYTES)
    assert p.decode_worker_message(p.encode(at_limit)) == at_limit
    over = "é" * (p.MAX_SIGNAL_PAYLOAD_BYTES // 2 + 1)  # fewer characters than the limit, more bytes
    with pytest.raises(p.ProtocolError):
        p.decode_worker_message(json.dumps({"type": "ClusterSignal", "attempt": "t", "payload": over}))
    with pytest.raises(ValueError):
        p.ClusterSignal(attempt="t", payload=over)


@given(st.text(max_size=64))
def test_any_text_is_a_message_or_a_protocol_error(text: str) -> None:
    try:
        decoded = p.decode_worker_message(text)
    except p.ProtocolError:
        return
    assert isinstance(decoded, p.WORKER_MESSAGE_TYPES)


def test_a_frame_over_1_mib_is_refused_before_it_is_parsed() -> None:
    big = '{"type": "RequestJobList"}' + " " * p.MAX_FRAME_BYTES
    assert p.frame_too_large(big) and p.frame_too_large(big.encode())
    assert not p.frame_too_large("x" * p.MAX_FRAME_BYTES)
    assert p.frame_too_large("é" * (p.MAX_FRAME_BYTES // 2 + 1))
    with pytest.raises(p.ProtocolError, match="larger than"):
        p.decode_worker_message(big)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"candidates": [], "is_final": 1}', type=p.JobListChunk)


def test_a_known_derivations_query_of_more_than_a_thousand_paths_is_refused() -> None:
    frame = msgspec.json.encode(
        {"type": "QueryKnownDerivations", "job_id": "j", "assignment_id": "a", "drv_paths": ["p"] * 1001}
    )
    with pytest.raises(p.ProtocolError):
        p.decode_worker_message(frame)


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        # ASCII, with an escaped NUL and an escaped lone surrogate: cleaned as ever.
        (
            '{"type":"JobFailed","job_id":"j","assignment_id":"a","error":"x\\u0000y\\ud800","kind":"transient",'
            '"elapsed_ms":1}',
            "x\ufffdy\ufffd",
        ),
        # Not ASCII, a raw lone surrogate (as a str may hold; UTF-8 off the wire cannot).
        (
            '{"type":"JobFailed","job_id":"j","assignment_id":"a","error":"é\ud800","kind":"transient",'
            '"elapsed_ms":1}',
            "é\ufffd",
        ),
        # ASCII without any escape, and an escape that is no NUL nor surrogate: as sent.
        (
            '{"type":"JobFailed","job_id":"j","assignment_id":"a","error":"plain","kind":"transient",'
            '"elapsed_ms":1}',
            "plain",
        ),
        (
            '{"type":"JobFailed","job_id":"j","assignment_id":"a","error":"\\u00e9","kind":"transient",'
            '"elapsed_ms":1}',
            "é",
        ),
    ],
)
def test_a_frames_text_is_made_storable_whatever_its_characters(frame: str, error: str) -> None:
    message = p.decode_worker_message(frame)
    assert isinstance(message, p.JobFailed) and message.error == error
