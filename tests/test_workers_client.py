"""The reference worker against a scripted server on a real loopback WebSocket: the handshake, offers
and scores, RequestJob per free slot, running jobs through the sim executor, AbortJob, cluster holds,
signals, refusals and the stop sequence."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.asyncio.server import Server, ServerConnection, serve

from gradient.core.protocol import (
    AbortCluster,
    AbortJob,
    AssignJob,
    AssignJobResponse,
    Building,
    BuildJob,
    BuildLog,
    BuildOutput,
    BuildRequirement,
    BuildSpec,
    ClusterAddress,
    ClusterMembership,
    ClusterPeer,
    ClusterSignal,
    ClusterSignalDelivery,
    Draining,
    EvalResult,
    EvaluatingDerivations,
    EvaluatingFlake,
    Fetching,
    FetchResult,
    FlakeJob,
    InitAck,
    InitConnection,
    JobCandidate,
    JobCompleted,
    JobFailed,
    JobListChunk,
    JobOffer,
    JobUpdate,
    KnownDerivations,
    Message,
    QueryKnownDerivations,
    Reject,
    RepositorySource,
    RequestJob,
    RequestJobChunk,
    RequestJobList,
    RequiredPath,
    StartCluster,
    WorkerCapabilities,
    WorkerMetrics,
    decode_worker_message,
    encode,
)
from gradient.workers.client.config import WorkerConfig
from gradient.workers.client.worker import EXIT_OK, EXIT_REJECTED, Worker, reconnect_delay
from gradient.workers.executors.sim import SimExecutor, graph_from_url, source_store_path

TIMEOUT = 10.0
NOISE = (WorkerMetrics, RequestJob, BuildLog)  # BuildLog: the sim builds print a few lines


@dataclass
class Peer:
    """The server's end of one worker connection."""

    ws: ServerConnection
    # What a QueryKnownDerivations is answered with (every query is answered, as the server does);
    # None: a query is not expected.
    known: set[str] | None = field(default_factory=set)
    queries: list[QueryKnownDerivations] = field(default_factory=list)

    async def send(self, message: Message) -> None:
        await self.ws.send(encode(message))

    async def recv(self) -> Message:
        return decode_worker_message(await asyncio.wait_for(self.ws.recv(), TIMEOUT))  # type: ignore[return-value]

    async def expect(self, kind: type[Message], skip: tuple[type[Message], ...] = NOISE) -> Message:
        while True:
            message = await self.recv()
            if isinstance(message, kind):
                return message
            if isinstance(message, QueryKnownDerivations) and self.known is not None:
                self.queries.append(message)
                await self.send(
                    KnownDerivations(
                        job_id=message.job_id,
                        assignment_id=message.assignment_id,
                        drv_paths=[p for p in message.drv_paths if p in self.known],
                    )
                )
                continue
            assert isinstance(message, skip), f"expected {kind.__name__}, got {message!r}"

    async def welcome(self, worker_id: str = "w1") -> InitConnection:
        init = await self.recv()
        assert isinstance(init, InitConnection)
        await self.send(InitAck(worker_id=worker_id, protocol=1, authorized_projects=["p"]))
        return init


class ScriptedServer:
    def __init__(self) -> None:
        self.peers: asyncio.Queue[Peer] = asyncio.Queue()
        self.server: Server | None = None

    async def _handler(self, ws: ServerConnection) -> None:
        await self.peers.put(Peer(ws))
        await ws.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = next(iter(self.server.sockets)).getsockname()[1]
        return f"ws://127.0.0.1:{port}/proto"

    async def accept(self) -> Peer:
        return await asyncio.wait_for(self.peers.get(), TIMEOUT)


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    scripted = ScriptedServer()
    async with serve(scripted._handler, "127.0.0.1", 0) as ws_server:
        scripted.server = ws_server
        yield scripted


def _worker(server: ScriptedServer, executor: SimExecutor | None = None, **overrides: object) -> Worker:
    settings: dict[str, object] = {
        "server": server.url,
        "worker_id": "w1",
        "token": "t",
        "executor": "sim",
        "architectures": ["x86_64-linux"],
        "system_features": ["kvm"],
        "max_concurrent_builds": 2,
        "cpu_core_score": 100,
        "heartbeat_secs": 60.0,
        "idle_request_secs": 60.0,
        "stop_grace_secs": 2.0,
        "reconnect_max_secs": 0.2,
    }
    settings.update(overrides)
    return Worker(WorkerConfig(**settings), executor or SimExecutor(build_ms=0))  # type: ignore[arg-type]


async def _started(server: ScriptedServer, worker: Worker) -> tuple[asyncio.Task[int], Peer]:
    """A running worker past the handshake, its offer list answered (empty)."""
    task = asyncio.create_task(worker.run())
    peer = await server.accept()
    await peer.welcome()
    await peer.expect(RequestJobList, skip=(WorkerCapabilities, WorkerMetrics))
    await peer.send(JobListChunk(candidates=[], is_final=True))
    await peer.expect(RequestJobChunk)
    return task, peer


async def _stop(worker: Worker, task: asyncio.Task[int]) -> int:
    worker.request_stop()
    return await asyncio.wait_for(task, TIMEOUT)


async def _requests_within(peer: Peer, seconds: float) -> int:
    """How many RequestJob frames arrive within the next `seconds`."""
    count = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    try:
        while (left := deadline - loop.time()) > 0:
            message = decode_worker_message(await asyncio.wait_for(peer.ws.recv(), left))
            count += isinstance(message, RequestJob)
    except TimeoutError:
        pass
    return count


def _flake_job(url: str = "sim:chain?n=3") -> FlakeJob:
    return FlakeJob(
        steps=["FetchFlake", "EvaluateFlake", "EvaluateDerivations"],
        source=RepositorySource(url=url, commit="c0ffee"),
        wildcards=["*"],
        timeout_secs=60,
    )


def _build_job(url: str, name: str) -> BuildJob:
    graph = graph_from_url(url)
    return BuildJob(
        builds=[
            BuildSpec(
                build_id=f"b-{name}",
                drv_path=graph.drv_path(name),
                outputs=[],
                timeout_secs=60,
                max_silent_secs=60,
            )
        ],
        requirement=BuildRequirement(architecture="x86_64-linux", required_features=[]),
    )


async def test_after_the_handshake_it_sends_capabilities_a_heartbeat_and_asks_for_offers(
    server: ScriptedServer,
) -> None:
    worker = _worker(server, zone="eu", endpoint="10.0.0.9:7000")
    task = asyncio.create_task(worker.run())
    peer = await server.accept()

    init = await peer.welcome()
    capabilities = await peer.recv()
    metrics = await peer.recv()
    listing = await peer.recv()

    assert isinstance(init, InitConnection) and (init.worker_id, init.token, init.protocol) == ("w1", "t", 1)
    assert (init.capabilities.fetch, init.capabilities.eval, init.capabilities.build) == (True, True, True)
    assert isinstance(capabilities, WorkerCapabilities)
    assert capabilities.architectures == ["x86_64-linux"] and capabilities.system_features == ["kvm"]
    assert (capabilities.max_concurrent_builds, capabilities.cpu_core_score) == (2, 100)
    assert (capabilities.zone, capabilities.endpoint) == ("eu", "10.0.0.9:7000")
    assert capabilities.cpu_count >= 1 and capabilities.ram_total_mb > 0
    assert isinstance(metrics, WorkerMetrics) and metrics.ram_free_mb is not None and metrics.ram_free_mb > 0
    assert isinstance(listing, RequestJobList)
    assert await _stop(worker, task) == EXIT_OK


async def test_it_scores_offers_against_its_store_then_requests_a_job_per_free_slot(
    server: ScriptedServer,
) -> None:
    local, remote = "/nix/store/" + "a" * 32 + "-dep", "/nix/store/" + "b" * 32 + "-big"
    worker = _worker(server, SimExecutor(store=[local, "/nix/store/" + "c" * 32 + "-out"]))
    task = asyncio.create_task(worker.run())
    peer = await server.accept()
    await peer.welcome()
    await peer.expect(RequestJobList, skip=(WorkerCapabilities, WorkerMetrics))
    candidate = JobCandidate(
        job_id="build:1",
        kind="build",
        required_paths=[RequiredPath(path=local, nar_size=10), RequiredPath(path=remote, nar_size=5000)],
        drv_paths=["/nix/store/x.drv"],
        output_paths=["/nix/store/" + "c" * 32 + "-out"],
        requirement=BuildRequirement(architecture="x86_64-linux", required_features=[]),
    )

    await peer.send(JobListChunk(candidates=[candidate], is_final=False))
    first = await peer.expect(RequestJobChunk)
    await peer.send(JobListChunk(candidates=[], is_final=True))
    last = await peer.expect(RequestJobChunk)
    requests = [await peer.expect(RequestJob) for _ in range(3)]
    await peer.send(JobOffer(candidates=[candidate]))
    offer = await peer.expect(RequestJobChunk)

    assert isinstance(first, RequestJobChunk) and not first.is_final
    [score] = first.scores
    assert (score.job_id, score.missing_count, score.missing_nar_size, score.outputs_present) == (
        "build:1",
        1,
        5000,
        True,
    )
    assert isinstance(last, RequestJobChunk) and last.is_final and last.scores == []
    assert sorted(r.kind for r in requests if isinstance(r, RequestJob)) == ["build", "build", "flake"]
    assert isinstance(offer, RequestJobChunk) and offer.is_final and offer.scores == first.scores
    assert await _stop(worker, task) == EXIT_OK


async def test_an_evaluation_job_reports_each_step_and_the_derivations(server: ScriptedServer) -> None:
    worker = _worker(server)
    task, peer = await _started(server, worker)

    await peer.send(AssignJob(job_id="eval:1", assignment_id="a1", job=_flake_job()))

    response = await peer.expect(AssignJobResponse)
    updates = []
    while True:
        message = await peer.expect(JobUpdate, skip=(*NOISE, JobCompleted))
        assert isinstance(message, JobUpdate)
        updates.append(message.update)
        if isinstance(message.update, EvalResult):
            break
    completed = await peer.expect(JobCompleted)

    assert isinstance(response, AssignJobResponse) and response.accepted and response.assignment_id == "a1"
    assert [type(u) for u in updates] == [
        Fetching,
        FetchResult,
        EvaluatingFlake,
        EvaluatingDerivations,
        EvalResult,
    ]
    fetched = updates[1]
    assert isinstance(fetched, FetchResult) and fetched.flake_source == source_store_path(
        "sim:chain?n=3", "c0ffee"
    )
    result = updates[-1]
    assert isinstance(result, EvalResult)
    assert [d.drv_path for d in result.derivations] == [
        graph_from_url("sim:chain?n=3").drv_path(f"chain-{i}") for i in range(3)
    ]
    assert isinstance(completed, JobCompleted) and completed.assignment_id == "a1"
    assert await _stop(worker, task) == EXIT_OK


async def test_a_build_job_reports_its_outputs_and_a_failing_one_its_failure(server: ScriptedServer) -> None:
    worker = _worker(server)
    task, peer = await _started(server, worker)
    url = "sim:chain?n=2&fail=chain-1"

    await peer.send(AssignJob(job_id="build:0", assignment_id="a0", job=_build_job(url, "chain-0")))
    await peer.expect(AssignJobResponse)
    building = await peer.expect(JobUpdate)
    output = await peer.expect(JobUpdate)
    done = await peer.expect(JobCompleted)
    await peer.send(AssignJob(job_id="build:1", assignment_id="a1", job=_build_job(url, "chain-1")))
    failed = await peer.expect(JobFailed, skip=(*NOISE, JobUpdate, AssignJobResponse))

    assert isinstance(building, JobUpdate) and building.update == Building(build_id="b-chain-0")
    assert isinstance(output, JobUpdate) and isinstance(output.update, BuildOutput)
    assert isinstance(done, JobCompleted) and done.job_id == "build:0"
    assert isinstance(failed, JobFailed) and failed.kind == "permanent" and failed.assignment_id == "a1"
    assert await _stop(worker, task) == EXIT_OK


async def test_it_repeats_its_request_while_slots_remain_and_declines_a_job_it_has_no_slot_for(
    server: ScriptedServer,
) -> None:
    worker = _worker(server, SimExecutor(build_ms=60_000), max_concurrent_builds=2)
    task, peer = await _started(server, worker)
    job = _build_job("sim:wide?n=3", "wide-0")
    await _requests_within(peer, 0.2)  # the first round, one RequestJob per free slot

    await peer.send(AssignJob(job_id="build:0", assignment_id="a0", job=job))
    first = await peer.expect(AssignJobResponse)
    again = await peer.expect(RequestJob, skip=(WorkerMetrics, JobUpdate))
    await peer.send(AssignJob(job_id="build:1", assignment_id="a1", job=job))
    second = await peer.expect(AssignJobResponse, skip=(*NOISE, JobUpdate))
    await peer.send(AssignJob(job_id="build:2", assignment_id="a2", job=job))
    third = await peer.expect(AssignJobResponse, skip=(*NOISE, JobUpdate))

    assert isinstance(first, AssignJobResponse) and first.accepted
    assert isinstance(again, RequestJob) and again.kind == "build"
    assert isinstance(second, AssignJobResponse) and second.accepted
    assert isinstance(third, AssignJobResponse) and not third.accepted and third.reason == "no free slot"
    assert await _stop(worker, task) == EXIT_OK


async def test_abort_job_cancels_a_running_job_which_reports_aborted(server: ScriptedServer) -> None:
    worker = _worker(server, SimExecutor(build_ms=60_000))
    task, peer = await _started(server, worker)
    await peer.send(AssignJob(job_id="build:0", assignment_id="a0", job=_build_job("sim:wide?n=1", "wide-0")))
    await peer.expect(JobUpdate, skip=(*NOISE, AssignJobResponse))

    await peer.send(AbortJob(job_id="build:0", assignment_id="a0", reason="evaluation canceled"))
    failed = await peer.expect(JobFailed)

    assert isinstance(failed, JobFailed)
    assert (failed.kind, failed.error, failed.assignment_id) == ("aborted", "evaluation canceled", "a0")
    assert await _stop(worker, task) == EXIT_OK


async def test_a_cluster_member_is_held_until_start_and_given_up_after_hold_secs(
    server: ScriptedServer,
) -> None:
    executor = SimExecutor(build_ms=0)
    worker = _worker(server, executor)
    task, peer = await _started(server, worker)
    job = _build_job("sim:wide?n=1", "wide-0")

    await peer.send(
        AssignJob(
            job_id="build:0",
            assignment_id="a0",
            job=job,
            cluster=ClusterMembership(attempt="t1", role="node", index=0, hold_secs=1),
        )
    )
    accepted = await peer.expect(AssignJobResponse)
    failed = await peer.expect(JobFailed)

    assert isinstance(accepted, AssignJobResponse) and accepted.accepted
    assert isinstance(failed, JobFailed) and (failed.kind, failed.error) == (
        "aborted",
        "cluster start timed out",
    )
    assert executor.built == []  # it ran nothing while held
    assert await _stop(worker, task) == EXIT_OK


async def test_cluster_members_start_together_and_exchange_signals_through_the_server(
    server: ScriptedServer,
) -> None:
    workers = [_worker(server, worker_id=f"w{i}") for i in range(2)]
    started = [await _started(server, w) for w in workers]
    peers = [peer for _, peer in started]
    roster = [ClusterPeer(role="node", index=i, worker_id=f"w{i}") for i in range(2)]
    job = _build_job("sim:wide?n=1", "wide-0")

    for i, peer in enumerate(peers):
        membership = ClusterMembership(attempt="t1", role="node", index=i, hold_secs=30)
        await peer.send(AssignJob(job_id=f"build:{i}", assignment_id=f"a{i}", job=job, cluster=membership))
        await peer.expect(AssignJobResponse)
    for peer in peers:
        await peer.send(StartCluster(attempt="t1", roster=roster))
    signals = [await peer.expect(ClusterSignal, skip=(*NOISE, JobUpdate)) for peer in peers]
    for i, signal in enumerate(signals):  # the server forwards each to the other member
        assert isinstance(signal, ClusterSignal) and signal.attempt == "t1" and signal.to is None
        other = peers[1 - i]
        sender = ClusterAddress(role=roster[i].role, index=roster[i].index)
        await other.send(ClusterSignalDelivery(attempt="t1", from_=sender, payload=signal.payload))
    completed = [await peer.expect(JobCompleted, skip=(*NOISE, JobUpdate)) for peer in peers]

    assert [s.payload for s in signals if isinstance(s, ClusterSignal)] == [
        "hello from node[0]",
        "hello from node[1]",
    ]
    assert [c.assignment_id for c in completed if isinstance(c, JobCompleted)] == ["a0", "a1"]
    for worker, (task, _) in zip(workers, started, strict=True):
        assert await _stop(worker, task) == EXIT_OK


async def test_abort_cluster_releases_a_held_member(server: ScriptedServer) -> None:
    worker = _worker(server)
    task, peer = await _started(server, worker)
    membership = ClusterMembership(attempt="t1", role="node", index=0, hold_secs=60)
    await peer.send(
        AssignJob(
            job_id="build:0", assignment_id="a0", job=_build_job("sim:wide?n=1", "wide-0"), cluster=membership
        )
    )
    await peer.expect(AssignJobResponse)

    await peer.send(AbortCluster(attempt="t1", reason="a member rejected"))
    failed = await peer.expect(JobFailed)

    assert isinstance(failed, JobFailed) and failed.kind == "aborted" and "a member rejected" in failed.error
    assert await _stop(worker, task) == EXIT_OK


async def test_on_stop_it_releases_held_members_drains_and_cancels_running_jobs(
    server: ScriptedServer,
) -> None:
    worker = _worker(server, SimExecutor(build_ms=60_000))
    task, peer = await _started(server, worker)
    await peer.send(AssignJob(job_id="build:0", assignment_id="a0", job=_build_job("sim:wide?n=2", "wide-0")))
    await peer.expect(JobUpdate, skip=(*NOISE, AssignJobResponse))
    membership = ClusterMembership(attempt="t1", role="node", index=0, hold_secs=60)
    await peer.send(
        AssignJob(
            job_id="build:1", assignment_id="a1", job=_build_job("sim:wide?n=2", "wide-1"), cluster=membership
        )
    )
    await peer.expect(AssignJobResponse)

    worker.request_stop()
    released = await peer.expect(JobFailed)
    draining = await peer.expect(Draining)
    canceled = await peer.expect(JobFailed)
    exit_code = await asyncio.wait_for(task, TIMEOUT)

    assert isinstance(released, JobFailed) and (released.assignment_id, released.kind, released.error) == (
        "a1",
        "aborted",
        "worker draining",
    )
    assert isinstance(draining, Draining)
    assert isinstance(canceled, JobFailed) and (canceled.assignment_id, canceled.kind) == ("a0", "canceled")
    assert exit_code == EXIT_OK


async def test_a_server_draining_gets_no_more_requests(server: ScriptedServer) -> None:
    worker = _worker(server, idle_request_secs=0.2)
    task, peer = await _started(server, worker)
    assert await _requests_within(peer, 0.5) > 0  # idle: it keeps asking

    await peer.send(Draining())
    await _requests_within(peer, 0.1)  # what was in flight before Draining arrived

    assert await _requests_within(peer, 1.0) == 0
    assert await _stop(worker, task) == EXIT_OK


@pytest.mark.parametrize(("code", "exit_code"), [(401, EXIT_REJECTED), (403, EXIT_REJECTED)])
async def test_a_refused_worker_exits_and_a_busy_one_retries(
    server: ScriptedServer, code: int, exit_code: int
) -> None:
    worker = _worker(server)
    task = asyncio.create_task(worker.run())

    # Busy, making room, a session still open, a server that restarted mid-handshake: all retried
    # (before, a 400, which the server answered to a socket it closed to make room, was final).
    for retried in (496, 503, 400):
        busy = await server.accept()
        await busy.recv()
        await busy.send(Reject(code=retried, reason="try again"))
        await busy.ws.close(4000 + retried)
    refused = await server.accept()  # it came back after its backoff
    await refused.recv()
    await refused.send(Reject(code=code, reason="no"))
    await refused.ws.close(4000 + code)

    assert await asyncio.wait_for(task, TIMEOUT) == exit_code


async def test_a_socket_closed_to_make_room_without_a_reject_frame_is_retried(server: ScriptedServer) -> None:
    worker = _worker(server)
    task = asyncio.create_task(worker.run())
    evicted = await server.accept()
    await evicted.recv()
    await evicted.ws.close(4503, "making room")  # the close code alone, its Reject lost on the way
    again = await server.accept()
    assert isinstance(await again.recv(), InitConnection)
    worker.request_stop()
    await again.ws.close(1000)
    assert await asyncio.wait_for(task, TIMEOUT) == EXIT_OK


async def test_a_fault_of_the_worker_itself_ends_the_session_said_why_never_the_process(
    server: ScriptedServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only 401 and 403 are final (issue 36, finding 3): an error of the worker's own in the handshake
    (it ended the process, with a traceback and no retry) or in a handler (the session ended unsaid) is
    logged with its traceback and the worker connects again."""
    worker = _worker(server)
    real_capabilities = worker.capabilities
    faults = iter([RuntimeError("capabilities unreadable")])

    def capabilities() -> WorkerCapabilities:
        for fault in faults:
            raise fault
        return real_capabilities()

    monkeypatch.setattr(worker, "capabilities", capabilities)
    task = asyncio.create_task(worker.run())
    first = await server.accept()
    await first.welcome()  # the worker fails sending its capabilities, its own fault
    peer = await server.accept()  # it came back
    assert not task.done()
    await peer.welcome()
    await peer.expect(RequestJobList, skip=(WorkerCapabilities, WorkerMetrics))

    async def present_paths(paths: object) -> set[str]:
        raise RuntimeError("the store is unreadable")

    monkeypatch.setattr(worker.executor, "present_paths", present_paths)
    candidate = JobCandidate(
        job_id="build:1",
        kind="build",
        required_paths=[],
        drv_paths=["/nix/store/x.drv"],
        output_paths=["/nix/store/" + "c" * 32 + "-out"],
        requirement=BuildRequirement(architecture="x86_64-linux", required_features=[]),
    )
    await peer.send(JobListChunk(candidates=[candidate], is_final=True))  # the handler fails
    again = await server.accept()
    assert isinstance(await again.recv(), InitConnection)
    failed = [r for r in caplog.records if r.getMessage().endswith("failed; retrying")]
    assert [str(r.exc_info[1]) for r in failed if r.exc_info] == [
        "capabilities unreadable",
        "the store is unreadable",
    ]
    assert not task.done()
    worker.request_stop()
    await again.ws.close(1000)
    assert await asyncio.wait_for(task, TIMEOUT) == EXIT_OK


@given(failures=st.integers(0, 200), cap=st.floats(1.0, 600.0), draw=st.floats(0.0, 1.0, exclude_max=True))
def test_the_reconnect_delay_grows_exponentially_to_its_cap_over_the_upper_half_of_its_step(
    failures: int, cap: float, draw: float
) -> None:
    step = min(cap, 2.0 ** max(failures - 1, 0))
    delay = reconnect_delay(failures, cap, draw)
    assert step / 2 <= delay <= step <= cap
    assert reconnect_delay(failures + 1, cap, draw) >= delay  # never shorter after one more failure


async def _eval_result(peer: Peer) -> EvalResult:
    await peer.send(AssignJob(job_id="eval:1", assignment_id="a1", job=_flake_job("sim:chain?n=4")))
    while True:
        message = await peer.expect(JobUpdate, skip=(*NOISE, AssignJobResponse))
        assert isinstance(message, JobUpdate)
        if isinstance(message.update, EvalResult):
            return message.update


async def test_it_asks_which_derivations_the_server_knows_and_leaves_their_closures_out(
    server: ScriptedServer,
) -> None:
    graph = graph_from_url("sim:chain?n=4")
    worker = _worker(server)
    task, peer = await _started(server, worker)
    # The chain's one top-level derivation is chain-3; it needs the three others.
    peer.known = {graph.drv_path("chain-3")}
    result = await _eval_result(peer)
    assert [(q.assignment_id, q.drv_paths) for q in peer.queries] == [("a1", [graph.drv_path("chain-3")])]
    assert result.known_drvs == [graph.drv_path("chain-3")]
    assert result.derivations == []  # its whole closure is left out
    assert await _stop(worker, task) == EXIT_OK


async def test_with_no_known_query_it_asks_nothing_and_sends_every_derivation(server: ScriptedServer) -> None:
    graph = graph_from_url("sim:chain?n=4")
    worker = _worker(server, known_query=False)
    task, peer = await _started(server, worker)
    peer.known = None  # a query fails the test
    result = await _eval_result(peer)
    assert not result.known_drvs
    assert {d.drv_path for d in result.derivations} == {graph.drv_path(f"chain-{i}") for i in range(4)}
    assert await _stop(worker, task) == EXIT_OK
