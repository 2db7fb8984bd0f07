"""The /proto consumer over the full ASGI application: the handshake and every Reject, every kind of
malformed frame (answered with Error{400} and close 4400, writing nothing), the session's lifecycle,
and pushes through the channel layer."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.db import transaction
from django.utils import timezone

from gradient.clusters.models import ClusterAttempt, ClusterJob, ClusterMember, ClusterSeat
from gradient.core.protocol import MAX_FRAME_BYTES, AbortJob
from gradient.recovery.models import ServerBoot
from gradient.runtime.boot import current_boot
from gradient.runtime.outbox import push_to_worker, push_to_worker_on_commit
from gradient.scheduling.models import CandidateScore, DispatchedJob, JobKind, build_key
from gradient.workers.models import IdleSlot, Worker, WorkerSession
from gradient.workers.proto import consumer as consumer_module
from gradient.workers.services import worker_deactivate, worker_session_close, workers_drop_silent
from tests.factories import DerivationBuildFactory, DispatchedJobFactory
from tests.support.proto import (
    TIMEOUT,
    expect_close,
    expect_refusal,
    finish,
    handshake,
    init_connection,
    open_socket,
    snapshot,
)

pytestmark = pytest.mark.django_db(transaction=True)

MakeWorker = Any


async def _worker(make_worker: MakeWorker, **kwargs: Any) -> tuple[Worker, str]:
    worker, token = await database_sync_to_async(make_worker)(**kwargs)
    return worker, token


@database_sync_to_async
def _sessions(worker: Worker) -> list[WorkerSession]:
    return list(WorkerSession.objects.filter(worker=worker).order_by("opened_at"))


@database_sync_to_async
def _reload(worker: Worker) -> Worker:
    return Worker.objects.get(id=worker.id)


# --- Handshake -------------------------------------------------------------------------------------


async def test_a_registered_worker_gets_init_ack_with_its_projects_and_an_open_session(
    make_worker: MakeWorker,
) -> None:
    worker, token = await _worker(make_worker, projects=("beta", "alpha"))

    comm, ack = await handshake(str(worker.id), token, fetch=False)

    assert ack == {
        "type": "InitAck",
        "worker_id": str(worker.id),
        "protocol": 1,
        "authorized_projects": ["alpha", "beta"],
    }
    [session] = await _sessions(worker)
    assert session.closed_at is None and session.server_boot == current_boot()
    stored = await _reload(worker)
    assert (stored.can_fetch, stored.can_eval, stored.can_build) == (False, True, True)
    assert stored.last_seen is not None
    await finish(comm)
    [session] = await _sessions(worker)
    assert session.closed_at is not None and session.close_reason.startswith("disconnected")


async def test_a_socket_that_completed_its_handshake_is_no_stranger_to_admission(
    make_worker: MakeWorker,
) -> None:
    """Out of admission's count of unauthenticated sockets as soon as its InitAck goes (issue 31: the
    count decides at once whether a newcomer is under every cap; a worker left in it made 1 000
    connecting at once look like strangers)."""
    from gradient.workers.proto import admission

    worker, token = await _worker(make_worker, projects=("alpha",))
    before = len(admission._strangers)
    comm, ack = await handshake(str(worker.id), token)
    assert ack["type"] == "InitAck"
    assert len(admission._strangers) == before
    await finish(comm)


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("bad token", 401),
        ("unknown worker", 403),
        ("worker id that is no uuid", 403),
        ("deactivated worker", 403),
        ("unsupported protocol", 400),
        ("another message first", 400),
    ],
)
async def test_each_handshake_refusal_sends_reject_closes_with_4000_plus_its_code_and_writes_nothing(
    make_worker: MakeWorker, case: str, code: int
) -> None:
    worker, token = await _worker(make_worker, active=case != "deactivated worker")
    frame: dict[str, Any] = init_connection(str(worker.id), token)
    if case == "bad token":
        frame["token"] = token + "x"
    elif case == "unknown worker":
        frame["worker_id"] = str(uuid.uuid4())
    elif case == "worker id that is no uuid":
        frame["worker_id"] = "not-a-uuid"
    elif case == "unsupported protocol":
        frame["protocol"] = 2
    elif case == "another message first":
        frame = {"type": "RequestJob", "kind": "build"}
    before = await snapshot()

    comm = await open_socket()
    await comm.send_json_to(frame)
    reject, close_code = await expect_refusal(comm, "Reject")
    await finish(comm)

    assert reject["code"] == code and reject["reason"]
    assert set(reject) == {"type", "code", "reason"}
    assert close_code == 4000 + code
    assert await snapshot() == before


async def test_a_second_session_of_the_same_worker_is_rejected_with_496_until_the_first_closes(
    make_worker: MakeWorker,
) -> None:
    worker, token = await _worker(make_worker)
    first, _ = await handshake(str(worker.id), token)
    before = await snapshot()

    second = await open_socket()
    await second.send_json_to(init_connection(str(worker.id), token))
    reject, close_code = await expect_refusal(second, "Reject")
    await finish(second)

    assert (reject["code"], close_code) == (496, 4496)
    assert await snapshot() == before
    await finish(first)
    third, _ = await handshake(str(worker.id), token)
    await finish(third)
    assert [s.closed_at is not None for s in await _sessions(worker)] == [True, True]


async def test_a_session_left_open_by_a_stopped_server_does_not_block_its_worker(
    make_worker: MakeWorker,
) -> None:
    worker, token = await _worker(make_worker)

    @database_sync_to_async
    def stale_session() -> WorkerSession:
        now = timezone.now()
        boot = ServerBoot.objects.create(
            hostname="gone", pid=1, started_at=now, last_heartbeat=now, stopped_at=now
        )
        return WorkerSession.objects.create(
            worker=worker, channel_name="x", server_boot=boot.id, opened_at=now, last_seen=now
        )

    stale = await stale_session()
    comm, _ = await handshake(str(worker.id), token)
    sessions = {s.id: s for s in await _sessions(worker)}
    assert sessions[stale.id].closed_at is not None
    assert sessions[stale.id].close_reason == "its server is gone"
    await finish(comm)


async def test_a_socket_that_never_says_init_connection_is_rejected(
    make_worker: MakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(consumer_module, "HANDSHAKE_TIMEOUT_SECS", 0.2)
    comm = await open_socket()
    reject, close_code = await expect_refusal(comm, "Reject")
    assert (reject["code"], close_code) == (400, 4400)
    await finish(comm)


# --- Malformed frames ------------------------------------------------------------------------------


def _oversized_but_valid_chunk() -> str:
    score = {
        "job_id": f"build:{uuid.uuid4()}",
        "missing_count": 1,
        "missing_nar_size": 1,
        "outputs_present": False,
    }
    per_score = len(json.dumps(score)) + 2
    scores = [dict(score, job_id=f"build:{uuid.uuid4()}") for _ in range(MAX_FRAME_BYTES // per_score + 10)]
    text = json.dumps({"type": "RequestJobChunk", "scores": scores, "is_final": True})
    assert len(text.encode()) > MAX_FRAME_BYTES
    return text


MALFORMED: dict[str, str | bytes] = {
    "invalid JSON": '{"type": "RequestJob", "kind": ',
    "JSON that is not an object": '["RequestJob"]',
    "no type": '{"kind": "build"}',
    "unknown type": '{"type": "RequestJobs", "kind": "build"}',
    "unknown field": '{"type": "RequestJob", "kind": "build", "slots": 2}',
    "missing field": '{"type": "RequestJobChunk", "scores": []}',
    "wrong type": '{"type": "RequestJob", "kind": 1}',
    "value outside the enum": '{"type": "RequestJob", "kind": "eval"}',
    "wrong type in a nested shape": (
        '{"type": "RequestJobChunk", "is_final": true, "scores": '
        '[{"job_id": "x", "missing_count": "1", "missing_nar_size": 0, "outputs_present": false}]}'
    ),
    "unknown field in a nested shape": (
        '{"type": "JobUpdate", "job_id": "x", "assignment_id": "y", "update": {"kind": "fetching", "at": 1}}'
    ),
    "unknown tag in a nested union": (
        '{"type": "JobUpdate", "job_id": "x", "assignment_id": "y", "update": {"kind": "compiling"}}'
    ),
    "negative count": '{"type": "WorkerMetrics", "ram_free_mb": 1, "build_peak_ram_mb": -1}',
    "server message sent by a worker": (
        '{"type": "InitAck", "worker_id": "x", "protocol": 1, "authorized_projects": []}'
    ),
    "not allowed in the current state": "INIT",  # a second InitConnection, filled in below
    "binary frame": b'{"type": "RequestJobList"}',
    "frame over 1 MiB": "OVERSIZED",
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_frame_after_the_handshake_gets_error_400_and_close_4400_and_writes_nothing(
    make_worker: MakeWorker, case: str
) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    frame = MALFORMED[case]
    if frame == "INIT":
        frame = json.dumps(init_connection(str(worker.id), token))
    elif frame == "OVERSIZED":
        frame = _oversized_but_valid_chunk()
    before = await snapshot(exclude_session_close=True)

    if isinstance(frame, bytes):
        await comm.send_to(bytes_data=frame)
    else:
        await comm.send_to(text_data=frame)
    error, close_code = await expect_refusal(comm, "Error")
    await finish(comm)

    assert error["code"] == 400 and error["message"]
    assert set(error) == {"type", "code", "message"}
    assert close_code == 4400
    assert await snapshot(exclude_session_close=True) == before
    [session] = await _sessions(worker)
    assert session.closed_at is not None and session.close_reason.startswith("protocol error")


@pytest.mark.parametrize(
    "case", ["invalid JSON", "unknown type", "unknown field", "wrong type", "frame over 1 MiB"]
)
async def test_a_malformed_first_frame_gets_error_400_and_close_4400_and_writes_nothing(
    make_worker: MakeWorker, case: str
) -> None:
    worker, token = await _worker(make_worker)
    frames = {
        "invalid JSON": "InitConnection",
        "unknown type": json.dumps({**init_connection(str(worker.id), token), "type": "Hello"}),
        "unknown field": json.dumps({**init_connection(str(worker.id), token), "name": "w"}),
        "wrong type": json.dumps({**init_connection(str(worker.id), token), "protocol": "1"}),
        "frame over 1 MiB": json.dumps(
            {**init_connection(str(worker.id), token), "token": "x" * MAX_FRAME_BYTES}
        ),
    }
    before = await snapshot()

    comm = await open_socket()
    await comm.send_to(text_data=frames[case])
    error, close_code = await expect_refusal(comm, "Error")
    await finish(comm)

    assert (error["code"], close_code) == (400, 4400)
    assert await snapshot() == before


# --- The session -----------------------------------------------------------------------------------


async def test_capabilities_replace_the_stored_fields_as_a_whole(make_worker: MakeWorker) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    first = {
        "type": "WorkerCapabilities",
        "architectures": ["x86_64-linux", "i686-linux"],
        "system_features": ["kvm", "big-parallel"],
        "max_concurrent_builds": 4,
        "cpu_count": 8,
        "ram_total_mb": 16000,
        "cpu_core_score": 1200,
        "zone": "eu-1",
        "endpoint": "10.0.0.1:7000",
    }
    await comm.send_json_to(first)
    await comm.send_json_to(
        {
            "type": "WorkerCapabilities",
            "architectures": ["aarch64-linux"],
            "system_features": [],
            "max_concurrent_builds": 2,
            "cpu_count": 4,
            "ram_total_mb": 8000,
            "cpu_core_score": 900,
        }
    )
    await comm.send_json_to({"type": "RequestJobList"})  # answered: the two before it were handled
    assert (await comm.receive_json_from(timeout=TIMEOUT))["type"] == "JobListChunk"

    stored = await _reload(worker)
    assert stored.architectures == ["aarch64-linux"] and stored.system_features == []
    assert (stored.max_concurrent_builds, stored.cpu_count, stored.ram_total_mb, stored.cpu_core_score) == (
        2,
        4,
        8000,
        900,
    )
    assert stored.zone is None and stored.endpoint is None and stored.capabilities_at is not None
    await finish(comm)


async def test_the_heartbeat_stores_the_latest_metrics_and_marks_the_worker_seen(
    make_worker: MakeWorker,
) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    long_ago = timezone.now() - timedelta(hours=1)

    @database_sync_to_async
    def age() -> None:
        Worker.objects.filter(id=worker.id).update(last_seen=long_ago)
        WorkerSession.objects.filter(worker=worker).update(last_seen=long_ago)

    await age()
    await comm.send_json_to({"type": "WorkerMetrics", "cpu_usage_pct": 12.5, "ram_free_mb": 2048})
    await comm.send_json_to({"type": "RequestJobList"})
    await comm.receive_json_from(timeout=TIMEOUT)
    await consumer_module.flush_presence()  # seen and metrics are written by the presence flush

    stored = await _reload(worker)
    [session] = await _sessions(worker)
    assert stored.cpu_usage_pct == 12.5 and stored.ram_free_mb == 2048
    assert stored.disk_speed_mbps is None and stored.metrics_at is not None
    assert stored.last_seen is not None and stored.last_seen > long_ago
    assert session.last_seen > long_ago
    await finish(comm)


async def test_any_message_marks_the_worker_seen(
    make_worker: MakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    long_ago = timezone.now() - timedelta(hours=1)

    @database_sync_to_async
    def age() -> None:
        Worker.objects.filter(id=worker.id).update(last_seen=long_ago)
        WorkerSession.objects.filter(worker=worker).update(last_seen=long_ago)

    await age()
    await comm.send_json_to({"type": "RequestJobList"})
    await comm.receive_json_from(timeout=TIMEOUT)
    await consumer_module.flush_presence()  # seen is written by the presence flush

    [session] = await _sessions(worker)
    stored = await _reload(worker)
    assert session.last_seen > long_ago
    assert stored.last_seen is not None and stored.last_seen > long_ago
    await finish(comm)


async def test_an_unanswered_request_job_becomes_an_idle_slot_and_gets_no_reply(
    make_worker: MakeWorker,
) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)

    await comm.send_json_to({"type": "RequestJob", "kind": "build"})
    await comm.send_json_to({"type": "RequestJob", "kind": "flake"})

    assert await comm.receive_nothing(timeout=0.5)
    kinds = await database_sync_to_async(
        lambda: sorted(IdleSlot.objects.filter(worker=worker).values_list("kind", flat=True))
    )()
    assert kinds == [JobKind.BUILD, JobKind.EVAL]
    await finish(comm)
    assert not await database_sync_to_async(IdleSlot.objects.filter(worker=worker).exists)()


async def test_a_draining_worker_is_marked_and_offers_no_idle_slot(make_worker: MakeWorker) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)

    await comm.send_json_to({"type": "RequestJob", "kind": "build"})
    await comm.send_json_to({"type": "Draining"})
    await comm.send_json_to({"type": "RequestJob", "kind": "flake"})
    await comm.send_json_to({"type": "RequestJobList"})
    await comm.receive_json_from(timeout=TIMEOUT)

    [session] = await _sessions(worker)
    assert session.draining
    assert not await database_sync_to_async(IdleSlot.objects.filter(worker=worker).exists)()
    await finish(comm)


async def test_scores_are_stored_per_worker_and_candidate(make_worker: MakeWorker) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    # A job that can still be handed out: scores of made-up or finished jobs are not kept.
    build = await database_sync_to_async(lambda: DerivationBuildFactory(status="Queued"))()
    job = build_key(build.id)

    for missing in (5, 2):
        await comm.send_json_to(
            {
                "type": "RequestJobChunk",
                "scores": [
                    {
                        "job_id": job,
                        "missing_count": missing,
                        "missing_nar_size": missing * 100,
                        "outputs_present": False,
                    }
                ],
                "is_final": True,
            }
        )
    await comm.send_json_to({"type": "RequestJobList"})
    await comm.receive_json_from(timeout=TIMEOUT)

    rows = await database_sync_to_async(
        lambda: list(
            CandidateScore.objects.filter(worker=worker).values_list(
                "job_id", "missing_count", "missing_nar_size"
            )
        )
    )()
    assert rows == [(job, 2, 200)]
    await finish(comm)


async def test_a_report_for_a_garbage_assignment_is_dropped_without_error_or_close(
    make_worker: MakeWorker,
) -> None:
    worker, token = await _worker(make_worker)
    dispatch = await database_sync_to_async(lambda: DispatchedJobFactory(worker=worker))()
    comm, _ = await handshake(str(worker.id), token)
    before = await snapshot()

    for assignment in ("not-a-uuid", str(uuid.uuid4())):
        await comm.send_json_to(
            {"type": "JobCompleted", "job_id": dispatch.job_id, "assignment_id": assignment, "elapsed_ms": 5}
        )
    assert await comm.receive_nothing(timeout=0.3)
    await comm.send_json_to({"type": "RequestJobList"})
    assert (await comm.receive_json_from(timeout=TIMEOUT))["type"] == "JobListChunk"

    after = await snapshot()
    assert after["dispatched_job"] == before["dispatched_job"]
    await finish(comm)


async def test_a_stale_close_changes_nothing(make_worker: MakeWorker) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    await finish(comm)
    [session] = await _sessions(worker)

    closed_again = await database_sync_to_async(worker_session_close)(
        session_id=session.id, reason="late", now=timezone.now()
    )

    [unchanged] = await _sessions(worker)
    assert not closed_again
    assert (unchanged.closed_at, unchanged.close_reason) == (session.closed_at, session.close_reason)


# --- Pushes ----------------------------------------------------------------------------------------


async def test_a_push_from_another_thread_reaches_the_connected_worker(make_worker: MakeWorker) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)
    message = AbortJob(job_id="build:x", assignment_id="a", reason="operator")

    thread = threading.Thread(target=push_to_worker, args=(worker.id, message))
    thread.start()
    thread.join()

    assert await comm.receive_json_from(timeout=TIMEOUT) == {
        "type": "AbortJob",
        "job_id": "build:x",
        "assignment_id": "a",
        "reason": "operator",
    }
    await finish(comm)


async def test_a_push_on_commit_is_sent_only_if_the_transaction_commits(make_worker: MakeWorker) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)

    @database_sync_to_async
    def push_in_transaction(commit: bool, reason: str) -> None:
        try:
            with transaction.atomic():
                push_to_worker_on_commit(worker.id, AbortJob(job_id="j", assignment_id="a", reason=reason))
                if not commit:
                    raise RuntimeError("roll back")
        except RuntimeError:
            pass

    await push_in_transaction(False, "rolled back")
    await push_in_transaction(True, "committed")

    assert (await comm.receive_json_from(timeout=TIMEOUT))["reason"] == "committed"
    assert await comm.receive_nothing(timeout=0.3)
    await finish(comm)


async def test_deactivating_a_worker_closes_its_socket_and_refuses_it_afterwards(
    make_worker: MakeWorker,
) -> None:
    worker, token = await _worker(make_worker)
    comm, _ = await handshake(str(worker.id), token)

    await database_sync_to_async(worker_deactivate)(worker_id=worker.id, now=timezone.now())

    assert await expect_close(comm) == 4403
    await finish(comm)
    [session] = await _sessions(worker)
    assert session.closed_at is not None and session.close_reason == "worker deactivated"
    again = await open_socket()
    await again.send_json_to(init_connection(str(worker.id), token))
    reject, code = await expect_refusal(again, "Reject")
    assert (reject["code"], code) == (403, 4403)
    await finish(again)


async def test_the_liveness_pass_drops_a_silent_worker_and_closes_its_socket(make_worker: MakeWorker) -> None:
    silent, silent_token = await _worker(make_worker)
    alive, alive_token = await _worker(make_worker)
    silent_comm, _ = await handshake(str(silent.id), silent_token)
    alive_comm, _ = await handshake(str(alive.id), alive_token)
    await database_sync_to_async(
        lambda: WorkerSession.objects.filter(worker=silent).update(
            last_seen=timezone.now() - timedelta(seconds=200)
        )
    )()

    dropped = await database_sync_to_async(workers_drop_silent)(now=timezone.now(), timeout_secs=120)

    assert dropped == 1
    assert await expect_close(silent_comm) == 4408
    await finish(silent_comm)
    [session] = await _sessions(silent)
    assert session.closed_at is not None and "silent" in session.close_reason
    [alive_session] = await _sessions(alive)
    assert alive_session.closed_at is None
    await finish(alive_comm)


# --- Cluster signals -------------------------------------------------------------------------------


async def test_a_cluster_signal_is_forwarded_only_within_a_started_attempt_from_a_member(
    make_worker: MakeWorker,
) -> None:
    a, a_token = await _worker(make_worker)
    b, b_token = await _worker(make_worker)
    c, c_token = await _worker(make_worker)
    outsider, outsider_token = await _worker(make_worker)

    @database_sync_to_async
    def cluster(started: bool) -> ClusterAttempt:
        job = ClusterJob.objects.create()
        now = timezone.now()
        attempt = ClusterAttempt.objects.create(
            cluster_job=job,
            number=1,
            created_at=now,
            started_at=now if started else None,
            seats=[
                {"role": "server", "index": 0, "worker_id": str(a.id), "zone": None},
                {"role": "client", "index": 0, "worker_id": str(b.id), "zone": None},
                {"role": "client", "index": 1, "worker_id": str(c.id), "zone": None},
            ],
        )
        for role, index, worker in (("server", 0, a), ("client", 0, b), ("client", 1, c)):
            build = DerivationBuildFactory()
            member = ClusterMember.objects.create(
                cluster_job=job, derivation_build=build, role=role, index=index
            )
            row = DispatchedJob.objects.create(
                kind=JobKind.BUILD,
                job_id=build_key(build.id),
                derivation_build=build,
                worker=worker,
                cluster_attempt=attempt,
                dispatched_at=now,
            )
            ClusterSeat.objects.create(
                attempt=attempt,
                member=member,
                role=role,
                index=index,
                kind=JobKind.BUILD,
                job_key=row.job_id,
                worker=worker,
                assignment=row,
                accepted_at=now if started else None,
            )
        return attempt

    started = await cluster(started=True)
    unstarted = await cluster(started=False)
    comms = {}
    for worker, token in ((a, a_token), (b, b_token), (c, c_token), (outsider, outsider_token)):
        comms[worker.id], _ = await handshake(str(worker.id), token)

    await comms[a.id].send_json_to(
        {"type": "ClusterSignal", "attempt": str(started.id), "payload": "hello all"}
    )
    await comms[b.id].send_json_to(
        {
            "type": "ClusterSignal",
            "attempt": str(started.id),
            "to": {"role": "server", "index": 0},
            "payload": "hi",
        }
    )
    await comms[a.id].send_json_to(
        {"type": "ClusterSignal", "attempt": str(unstarted.id), "payload": "early"}
    )
    await comms[outsider.id].send_json_to(
        {"type": "ClusterSignal", "attempt": str(started.id), "payload": "spoof"}
    )
    await comms[a.id].send_json_to({"type": "ClusterSignal", "attempt": "garbage", "payload": "x"})

    hello = {
        "type": "ClusterSignal",
        "attempt": str(started.id),
        "from": {"role": "server", "index": 0},
        "payload": "hello all",
    }
    assert await comms[b.id].receive_json_from(timeout=TIMEOUT) == hello
    assert await comms[c.id].receive_json_from(timeout=TIMEOUT) == hello
    assert await comms[a.id].receive_json_from(timeout=TIMEOUT) == {
        "type": "ClusterSignal",
        "attempt": str(started.id),
        "from": {"role": "client", "index": 0},
        "payload": "hi",
    }
    for comm in comms.values():
        assert await comm.receive_nothing(timeout=0.3)
    # (Disconnecting a member loses it into its attempt, which aborts the others: check first, then close.)
    for comm in comms.values():
        await finish(comm)


def test_every_message_a_worker_may_send_after_its_handshake_has_a_handler() -> None:
    """A message protocol.md specifies never costs the session for want of a handler (issue 36, finding
    4: QueryKnownDerivations, unhandled, was answered Error 400 and the session closed with 4400)."""
    from typing import get_args

    from gradient.core.protocol import InitConnection, WorkerMessage

    specified = set(get_args(WorkerMessage)) - {InitConnection}
    assert specified - set(consumer_module.JOB_LOOP) == set()
    assert set(consumer_module.JOB_LOOP) <= specified
