"""The reference worker: one WebSocket session at a time to the server's /proto, reconnecting with
backoff, doing what the design says a worker does.

After InitAck it sends WorkerCapabilities (build-capable workers), a first heartbeat and
RequestJobList; it scores every offered candidate against its local store (RequestJobChunk), sends
RequestJob for each free slot once the list is in, again after each AssignJob while slots remain,
after each finished job, and every `idle_request_secs` while idle. It runs AssignJob jobs through its
executor, reporting JobUpdate / JobCompleted / JobFailed; AbortJob cancels; a cluster member is held
(nothing runs) until StartCluster and released with JobFailed{aborted, "cluster start timed out"}
after hold_secs; ClusterSignals travel between the executor and the server. On SIGTERM it stops as the
reference notes say (Worker stop).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidURI, WebSocketException

from gradient.core.protocol import (
    MAX_KNOWN_QUERY_PATHS,
    PROTOCOL_VERSION,
    AbortCluster,
    AbortJob,
    AssignJob,
    AssignJobResponse,
    BuildFailureKind,
    Building,
    BuildJob,
    BuildOutput,
    BuildProgress,
    CachedSource,
    ClusterAddress,
    ClusterPeer,
    ClusterSignal,
    ClusterSignalDelivery,
    DiscoveredDerivation,
    Draining,
    Error,
    EvalProgress,
    EvaluatingDerivations,
    EvaluatingFlake,
    Fetching,
    FetchResult,
    FlakeJob,
    FlakeSource,
    InitAck,
    InitCapabilities,
    InitConnection,
    JobCandidate,
    JobCompleted,
    JobFailed,
    JobKindName,
    JobListChunk,
    JobOffer,
    JobUpdate,
    JobUpdateKind,
    KnownDerivations,
    Message,
    ProtocolError,
    QueryKnownDerivations,
    Reject,
    RequestJob,
    RequestJobChunk,
    RequestJobList,
    ServerMessage,
    StartCluster,
    WorkerCapabilities,
    decode_server_message,
    encode,
    tag_of,
)
from gradient.workers.client.config import WorkerConfig
from gradient.workers.client.logs import LogStream
from gradient.workers.client.metrics import collect_metrics, cpu_core_benchmark, hardware, prime_cpu_usage
from gradient.workers.client.parts import DerivationTooLarge, eval_result_parts
from gradient.workers.client.scoring import paths_to_check, score_candidates
from gradient.workers.executors.base import Executor, ExecutorFailure, JobContext

log = logging.getLogger("gradient.worker")

# Every QueryKnownDerivations is answered (protocol.md); one that is not within this long is taken as
# "none known", and the whole result is sent.
KNOWN_QUERY_TIMEOUT_SECS = 60.0

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_REJECTED = 3
# Only these say the worker itself is refused (bad token, unknown or deactivated worker): retrying
# cannot help. Every other refusal (503 busy or making room, 496 a session still open, even a 400 of a
# server that restarted mid-handshake) is retried: a worker that exits on one stays away for good.
FATAL_REJECTS = frozenset({401, 403})
FIRST_BACKOFF_SECS = 1.0
HANDSHAKE_TIMEOUT_SECS = 30.0
BUILD_TIMEOUT_BACKSTOP_SECS = 10  # past a build's timeout_secs, when its executor has not ended it
MAX_FRAME = 8 * 1024 * 1024  # what we accept from the server (a page of 1 000 candidates fits)


class Rejected(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


@dataclass(eq=False)
class Job:
    assign: AssignJob
    kind: JobKindName
    signals: asyncio.Queue[ClusterSignalDelivery] = field(default_factory=asyncio.Queue)
    roster: list[ClusterPeer] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    hold: asyncio.Task[None] | None = None
    cancel_kind: BuildFailureKind | None = None
    cancel_reason: str = ""
    started: float = field(default_factory=time.monotonic)
    logs: dict[str, LogStream] = field(default_factory=dict)  # by build_id, while each build runs
    known: asyncio.Queue[KnownDerivations] = field(default_factory=asyncio.Queue)  # answers, in order

    @property
    def held(self) -> bool:
        return self.assign.cluster is not None and self.task is None

    def elapsed_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000)


class Context(JobContext):
    def __init__(self, connection: Connection, job: Job) -> None:
        self._connection = connection
        self._job = job
        self.job_id = job.assign.job_id
        self.assignment_id = job.assign.assignment_id
        self.cluster = job.assign.cluster
        self.roster = job.roster

    async def progress(self, message: BuildProgress | EvalProgress) -> None:
        await self._connection.send(message)

    def open_log(self, build_id: str) -> LogStream:
        stream = LogStream(
            self._connection.send, job_id=self.job_id, assignment_id=self.assignment_id, build_id=build_id
        )
        self._job.logs[build_id] = stream
        return stream

    def build_log(self, build_id: str, text: str) -> None:
        stream = self._job.logs.get(build_id)
        if stream is not None:
            stream.write(text)

    async def send_signal(self, payload: str, to: ClusterAddress | None = None) -> None:
        if self.cluster is None:
            raise RuntimeError("only a cluster member can signal its peers")
        await self._connection.send(ClusterSignal(attempt=self.cluster.attempt, payload=payload, to=to))

    async def receive_signal(self, wait_secs: float) -> ClusterSignalDelivery | None:
        try:
            return await asyncio.wait_for(self._job.signals.get(), timeout=wait_secs)
        except TimeoutError:
            return None

    async def known_derivations(self, drv_paths: Sequence[str]) -> set[str]:
        if not self._connection.config.known_query:
            return set()
        known: set[str] = set()
        paths = list(dict.fromkeys(drv_paths))
        for i in range(0, len(paths), MAX_KNOWN_QUERY_PATHS):
            await self._connection.send(
                QueryKnownDerivations(
                    job_id=self.job_id,
                    assignment_id=self.assignment_id,
                    drv_paths=paths[i : i + MAX_KNOWN_QUERY_PATHS],
                )
            )
            try:
                answer = await asyncio.wait_for(self._job.known.get(), timeout=KNOWN_QUERY_TIMEOUT_SECS)
            except TimeoutError:  # every query is answered; a server that does not is asked no more
                log.warning(
                    "no KnownDerivations within %s s: sending every derivation", KNOWN_QUERY_TIMEOUT_SECS
                )
                return known
            known.update(answer.drv_paths)
        return known


class Worker:
    """The process: its settings, its executor, and the reconnect loop."""

    def __init__(self, config: WorkerConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.architectures = (
            config.architectures if config.architectures is not None else executor.default_architectures()
        )
        self.system_features = (
            config.system_features
            if config.system_features is not None
            else executor.default_system_features()
        )
        self.cpu_count, self.ram_total_mb = hardware()
        self.cpu_core_score = (
            config.cpu_core_score if config.cpu_core_score is not None else cpu_core_benchmark()
        )
        self._stop: asyncio.Event | None = None

    @property
    def stop_event(self) -> asyncio.Event:
        if self._stop is None:
            self._stop = asyncio.Event()
        return self._stop

    def request_stop(self) -> None:
        log.info("stop requested: draining")
        self.stop_event.set()

    def capabilities(self) -> WorkerCapabilities:
        return WorkerCapabilities(
            architectures=list(self.architectures),
            system_features=list(self.system_features),
            max_concurrent_builds=self.config.max_concurrent_builds,
            cpu_count=self.cpu_count,
            ram_total_mb=self.ram_total_mb,
            cpu_core_score=self.cpu_core_score,
            zone=self.config.zone,
            endpoint=self.config.endpoint,
        )

    async def run(self) -> int:
        """Connect, serve, reconnect with backoff until stopped. Returns the process exit code."""
        prime_cpu_usage()
        failures = 0
        while not self.stop_event.is_set():
            session: Connection | None = None
            crashed = False
            try:
                async with connect(
                    self.config.server,
                    max_size=MAX_FRAME,
                    open_timeout=10,
                    ping_interval=20,
                    ping_timeout=20,
                    close_timeout=5,
                ) as ws:
                    session = Connection(self, ws)
                    await session.serve()
            except Rejected as rejected:
                if rejected.code in FATAL_REJECTS:
                    log.error("the server refused this worker (%s): %s", rejected.code, rejected.reason)
                    return EXIT_REJECTED
                why = f"the server refused this session ({rejected.code}): {rejected.reason}"
                log.warning("%s; retrying", why)
            except InvalidURI as exc:
                log.error("bad --server: %s", exc)
                return EXIT_CONFIG
            except (OSError, WebSocketException, TimeoutError, ProtocolError) as exc:
                log.warning(
                    "connection to %s lost or failed: %s", self.config.server, exc or type(exc).__name__
                )
            except Exception:
                # Anything else (a fault of this worker's own, a handler's, the executor's) ends the
                # session, never the process: a worker that exits stays away for good.
                log.exception("the session with %s failed; retrying", self.config.server)
                crashed = True
            if self.stop_event.is_set():
                break
            # Back to the first step only after a session that got its InitAck and did not fail of its
            # own: a server that accepts the socket and then refuses it, or a fault that recurs, is no
            # reason to come back faster.
            got_in = session is not None and session.acknowledged
            failures = 0 if got_in and not crashed else failures + 1
            delay = reconnect_delay(failures, self.config.reconnect_max_secs, random.random())  # noqa: S311
            log.info("reconnecting in %.1f s", delay)
            try:
                await asyncio.wait_for(self.stop_event.wait(), timeout=delay)
            except TimeoutError:
                pass
        log.info("stopped")
        return EXIT_OK


def reconnect_delay(failures: int, cap_secs: float, draw: float) -> float:
    """Seconds before the next connection attempt after `failures` failed ones in a row (0: the last
    session had got in): exponential from FIRST_BACKOFF_SECS, capped at `cap_secs`, and jittered over
    its upper half by `draw` in [0, 1) so that a fleet the same restart threw out comes back spread
    out rather than all at once."""
    ceiling = min(cap_secs, FIRST_BACKOFF_SECS * 2.0 ** min(max(failures - 1, 0), 30))
    return ceiling / 2 + ceiling / 2 * draw


class Connection:
    """One session: handshake, job loop, and the stop sequence."""

    def __init__(self, worker: Worker, ws: ClientConnection) -> None:
        self.worker = worker
        self.config = worker.config
        self.executor = worker.executor
        self.ws = ws
        self.jobs: dict[str, Job] = {}  # by assignment_id
        self.server_draining = False
        self.listed = False
        self.acknowledged = False  # InitAck came
        self._send_lock = asyncio.Lock()
        self._handlers: dict[type[Message], Callable[[Any], Awaitable[None]]] = {
            JobListChunk: self.on_job_list_chunk,
            JobOffer: self.on_job_offer,
            AssignJob: self.on_assign_job,
            AbortJob: self.on_abort_job,
            StartCluster: self.on_start_cluster,
            AbortCluster: self.on_abort_cluster,
            ClusterSignalDelivery: self.on_cluster_signal,
            KnownDerivations: self.on_known_derivations,
            Draining: self.on_draining,
            Error: self.on_error,
            InitAck: self.on_unexpected,
            Reject: self.on_unexpected,
        }

    async def send(self, message: Message) -> None:
        async with self._send_lock:
            await self.ws.send(encode(message))

    def capacity(self, kind: JobKindName) -> int:
        if kind == "build":
            return self.config.max_concurrent_builds if self.config.build else 0
        return self.config.max_concurrent_evals if (self.config.eval or self.config.fetch) else 0

    def free(self, kind: JobKindName) -> int:
        return self.capacity(kind) - sum(1 for j in self.jobs.values() if j.kind == kind)

    @property
    def stopping(self) -> bool:
        return self.worker.stop_event.is_set()

    # --- session --------------------------------------------------------------------------------------

    async def handshake(self) -> None:
        await self.send(
            InitConnection(
                worker_id=self.config.worker_id,
                token=self.config.token,
                capabilities=InitCapabilities(
                    fetch=self.config.fetch, eval=self.config.eval, build=self.config.build
                ),
                protocol=PROTOCOL_VERSION,
            )
        )
        try:
            frame = await asyncio.wait_for(self.ws.recv(), timeout=HANDSHAKE_TIMEOUT_SECS)
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else 1006
            if code >= 4000:
                raise Rejected(code - 4000, exc.rcvd.reason if exc.rcvd else "") from None
            raise
        message = decode_server_message(frame)
        if isinstance(message, Reject):
            raise Rejected(message.code, message.reason)
        if isinstance(message, Error):
            raise Rejected(message.code, message.message)
        if not isinstance(message, InitAck):
            raise ProtocolError(f"expected InitAck, got {tag_of(type(message))}")
        self.acknowledged = True
        log.info(
            "connected to %s as %s (projects: %s)",
            self.config.server,
            message.worker_id,
            ", ".join(message.authorized_projects) or "none",
        )
        if self.config.build:
            await self.send(self.worker.capabilities())
        await self.send(collect_metrics(build_peak_ram_mb=self.executor.build_peak_ram_mb()))
        await self.send(RequestJobList())

    async def serve(self) -> None:
        await self.handshake()
        reader = asyncio.create_task(self.read_loop(), name="reader")
        stop = asyncio.create_task(self.worker.stop_event.wait(), name="stop")
        helpers = [
            asyncio.create_task(self.heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self.idle_loop(), name="idle"),
        ]
        try:
            done, _ = await asyncio.wait([reader, stop, *helpers], return_when=asyncio.FIRST_COMPLETED)
            if stop in done and not reader.done():
                await self.drain_and_close()
        finally:
            for task in [reader, stop, *helpers]:
                task.cancel()
            await self.abandon_jobs()
            await asyncio.gather(reader, stop, *helpers, return_exceptions=True)
        # What ended the session, when a task of it failed (the reader's handler, a heartbeat): raised
        # for run() to log and retry. Before, it was dropped unsaid and the worker came straight back.
        for task in (reader, *helpers):
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure

    async def read_loop(self) -> None:
        try:
            async for frame in self.ws:
                try:
                    message = decode_server_message(frame)
                except ProtocolError as exc:
                    log.error("undecodable frame from the server: %s", exc)
                    continue
                handler = self._handlers.get(type(message))
                if handler is not None:
                    await handler(message)
        except ConnectionClosed as exc:
            log.warning("the server closed the connection: %s", exc)
        close = self.ws.close_code
        if close is not None:
            log.info("connection closed (%s %s)", close, self.ws.close_reason or "")

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_secs)
            await self.send(collect_metrics(build_peak_ram_mb=self.executor.build_peak_ram_mb()))

    async def idle_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.idle_request_secs)
            self.listed = True  # no list answer in a whole period: ask for jobs anyway
            await self.request_free_slots()

    async def request_free_slots(self) -> None:
        if self.stopping or self.server_draining:
            return
        for kind in self.config.job_kinds:
            for _ in range(max(0, self.free(kind))):
                await self.send(RequestJob(kind=kind))

    async def request_one(self, kind: JobKindName) -> None:
        if not (self.stopping or self.server_draining) and self.listed and self.free(kind) > 0:
            await self.send(RequestJob(kind=kind))

    # --- offers ---------------------------------------------------------------------------------------

    async def _scores(self, candidates: list[JobCandidate]) -> list[Any]:
        present = await self.executor.present_paths(paths_to_check(candidates))
        return score_candidates(candidates, present)

    async def on_job_list_chunk(self, message: JobListChunk) -> None:
        await self.send(
            RequestJobChunk(scores=await self._scores(message.candidates), is_final=message.is_final)
        )
        if message.is_final and not self.listed:
            self.listed = True
            await self.request_free_slots()

    async def on_job_offer(self, message: JobOffer) -> None:
        await self.send(RequestJobChunk(scores=await self._scores(message.candidates), is_final=True))

    # --- assignments ----------------------------------------------------------------------------------

    def _can_run(self, kind: JobKindName) -> bool:
        return self.config.build if kind == "build" else (self.config.eval or self.config.fetch)

    async def on_assign_job(self, message: AssignJob) -> None:
        kind: JobKindName = "flake" if isinstance(message.job, FlakeJob) else "build"
        if message.assignment_id in self.jobs:
            return  # a repeated push of a job we hold
        reason = None
        if self.stopping:
            reason = "worker draining"
        elif not self._can_run(kind):
            reason = f"this worker does not run {kind} jobs"
        elif self.free(kind) <= 0:
            reason = "no free slot"
        if reason is not None:
            await self.send(
                AssignJobResponse(
                    job_id=message.job_id, assignment_id=message.assignment_id, accepted=False, reason=reason
                )
            )
            return
        job = Job(assign=message, kind=kind)
        self.jobs[message.assignment_id] = job
        await self.send(
            AssignJobResponse(job_id=message.job_id, assignment_id=message.assignment_id, accepted=True)
        )
        if message.cluster is not None:
            log.info("holding %s for cluster attempt %s", message.job_id, message.cluster.attempt)
            job.hold = asyncio.create_task(self._hold_expiry(job, message.cluster.hold_secs))
        else:
            self._start(job)
            await self.request_one(kind)

    async def _hold_expiry(self, job: Job, hold_secs: float) -> None:
        await asyncio.sleep(hold_secs)
        if job.held and self.jobs.get(job.assign.assignment_id) is job:
            job.hold = None
            await self._release_held(job, "cluster start timed out")

    async def _release_held(self, job: Job, error: str) -> None:
        self.jobs.pop(job.assign.assignment_id, None)
        if job.hold is not None:
            job.hold.cancel()
            job.hold = None
        await self.send(
            JobFailed(
                job_id=job.assign.job_id,
                assignment_id=job.assign.assignment_id,
                error=error,
                kind=BuildFailureKind.ABORTED,
                elapsed_ms=job.elapsed_ms(),
            )
        )
        await self.request_one(job.kind)

    def _start(self, job: Job) -> None:
        job.started = time.monotonic()
        job.task = asyncio.create_task(self.run_job(job), name=f"job {job.assign.job_id}")

    def _cancel(self, job: Job, kind: BuildFailureKind, reason: str) -> None:
        if job.task is not None and not job.task.done():
            job.cancel_kind, job.cancel_reason = kind, reason
            job.task.cancel()

    def _jobs_of_attempt(self, attempt: str) -> list[Job]:
        return [
            j
            for j in self.jobs.values()
            if j.assign.cluster is not None and j.assign.cluster.attempt == attempt
        ]

    async def on_start_cluster(self, message: StartCluster) -> None:
        for job in self._jobs_of_attempt(message.attempt):
            if job.held:
                if job.hold is not None:
                    job.hold.cancel()
                    job.hold = None
                job.roster[:] = message.roster
                log.info("cluster attempt %s started: running %s", message.attempt, job.assign.job_id)
                self._start(job)

    async def on_abort_cluster(self, message: AbortCluster) -> None:
        for job in self._jobs_of_attempt(message.attempt):
            if job.held:
                await self._release_held(job, f"cluster aborted: {message.reason}")
            else:
                self._cancel(job, BuildFailureKind.ABORTED, f"cluster aborted: {message.reason}")

    async def on_abort_job(self, message: AbortJob) -> None:
        job = self.jobs.get(message.assignment_id)
        if job is None or job.assign.job_id != message.job_id:
            return
        if job.held:
            await self._release_held(job, message.reason)
        else:
            self._cancel(job, BuildFailureKind.ABORTED, message.reason)

    async def on_cluster_signal(self, message: ClusterSignalDelivery) -> None:
        log.info(
            "cluster signal in attempt %s from %s[%d]: %.200s",
            message.attempt,
            message.from_.role,
            message.from_.index,
            message.payload,
        )
        for job in self._jobs_of_attempt(message.attempt):
            job.signals.put_nowait(message)

    async def on_known_derivations(self, message: KnownDerivations) -> None:
        job = self.jobs.get(message.assignment_id)
        if job is not None:
            job.known.put_nowait(message)

    async def on_draining(self, message: Draining) -> None:
        log.info("the server is draining: no new jobs")
        self.server_draining = True

    async def on_error(self, message: Error) -> None:
        log.error("the server refused a frame (%s): %s", message.code, message.message)

    async def on_unexpected(self, message: ServerMessage) -> None:
        log.warning("unexpected %s from the server", tag_of(type(message)))

    # --- running a job --------------------------------------------------------------------------------

    async def _update(self, job: Job, update: JobUpdateKind) -> None:
        await self.send(
            JobUpdate(job_id=job.assign.job_id, assignment_id=job.assign.assignment_id, update=update)
        )

    async def run_job(self, job: Job) -> None:
        ctx = Context(self, job)
        assign = job.assign
        report: Message | None = None
        try:
            if isinstance(assign.job, FlakeJob):
                timeout = assign.job.timeout_secs or None
                async with asyncio.timeout(timeout):
                    await self._run_flake(job, assign.job, ctx)
            else:
                await self._run_build(job, assign.job, ctx)
            report = JobCompleted(
                job_id=assign.job_id, assignment_id=assign.assignment_id, elapsed_ms=job.elapsed_ms()
            )
        except ExecutorFailure as failure:
            report = self._failed(job, failure.kind, failure.error, failure.missing_paths)
        except TimeoutError:
            report = self._failed(job, BuildFailureKind.TIMEOUT, "the job timed out")
        except asyncio.CancelledError:
            await self._abort_executor(ctx)
            if job.cancel_kind is None:  # torn down with the connection: nobody to report to
                self.jobs.pop(assign.assignment_id, None)
                raise
            report = self._failed(job, job.cancel_kind, job.cancel_reason)
        except Exception as exc:  # an executor bug must not take the worker down
            log.exception("job %s failed unexpectedly", assign.job_id)
            report = self._failed(job, BuildFailureKind.TRANSIENT, f"worker error: {exc!r}")
        self.jobs.pop(assign.assignment_id, None)
        try:
            await self.send(report)
            log.info("%s %s", tag_of(type(report)), assign.job_id)
            await self.request_one(job.kind)
        except ConnectionClosed:
            log.warning("could not report %s: the connection is gone", assign.job_id)

    def _failed(
        self, job: Job, kind: BuildFailureKind, error: str, missing_paths: list[str] | None = None
    ) -> JobFailed:
        return JobFailed(
            job_id=job.assign.job_id,
            assignment_id=job.assign.assignment_id,
            error=error,
            kind=kind,
            elapsed_ms=job.elapsed_ms(),
            missing_paths=missing_paths,
        )

    async def _abort_executor(self, ctx: Context) -> None:
        try:
            await asyncio.shield(self.executor.abort(ctx))
        except Exception:
            log.exception("aborting %s in the executor failed", ctx.job_id)

    @staticmethod
    def _flake_ref(source: FlakeSource) -> str:
        return source.store_path if isinstance(source, CachedSource) else source.url

    async def _run_flake(self, job: Job, flake_job: FlakeJob, ctx: Context) -> None:
        flake: str | None = None
        attrs: list[str] | None = None
        warnings: list[str] = []
        for step in flake_job.steps:
            if step == "FetchFlake":
                await self._update(job, Fetching())
                flake = await self.executor.fetch(flake_job.source, ctx)
                await self._update(job, FetchResult(flake_source=flake))
            elif step == "EvaluateFlake":
                await self._update(job, EvaluatingFlake())
                evaluation = await self.executor.evaluate_flake(
                    flake or self._flake_ref(flake_job.source), flake_job.wildcards, ctx
                )
                attrs, warnings = evaluation.attrs, warnings + evaluation.warnings
            elif step == "EvaluateDerivations":
                await self._update(job, EvaluatingDerivations())
                ref = flake or self._flake_ref(flake_job.source)
                if attrs is None:
                    attrs = (await self.executor.evaluate_flake(ref, flake_job.wildcards, ctx)).attrs
                result = await self.executor.evaluate_derivations(ref, attrs, ctx)
                await self._send_eval_result(
                    job, result.derivations, warnings + result.warnings, result.errors, result.known_drvs
                )

    async def _send_eval_result(
        self,
        job: Job,
        derivations: list[DiscoveredDerivation],
        warnings: list[str],
        errors: list[str],
        known_drvs: list[str],
    ) -> None:
        """The result in parts that each fit a frame (client/parts.py), in order on this assignment."""
        try:
            parts = eval_result_parts(
                derivations=derivations,
                warnings=warnings,
                errors=errors,
                known_drvs=known_drvs,
                job_id=job.assign.job_id,
                assignment_id=job.assign.assignment_id,
                budget=self.config.eval_part_bytes,
            )
        except DerivationTooLarge as exc:
            raise ExecutorFailure(BuildFailureKind.PERMANENT, str(exc)) from None
        if len(parts) > 1:
            log.info(
                "eval_result of %s: %d derivations in %d parts",
                job.assign.job_id,
                len(derivations),
                len(parts),
            )
        for part in parts:
            await self._update(job, part)

    async def _run_build(self, job: Job, build_job: BuildJob, ctx: Context) -> None:
        for spec in build_job.builds:
            await self._update(job, Building(build_id=spec.build_id))
            # The executor enforces timeout_secs itself (with its own error text); this is the backstop.
            backstop = spec.timeout_secs + BUILD_TIMEOUT_BACKSTOP_SECS if spec.timeout_secs else None
            stream = ctx.open_log(spec.build_id)
            try:
                async with asyncio.timeout(backstop):
                    result = await self.executor.build(spec, ctx)
            finally:
                # The log's last piece goes before the build_output or the JobFailed.
                job.logs.pop(spec.build_id, None)
                if self._torn_down(job):
                    stream.abandon()
                else:
                    await stream.close()
            await self._update(
                job,
                BuildOutput(build_id=spec.build_id, outputs=result.outputs, substituted=result.substituted),
            )

    def _torn_down(self, job: Job) -> bool:
        """The session is over for this job (it is no longer held): its log has nobody to go to."""
        return self.jobs.get(job.assign.assignment_id) is not job

    # --- stopping -------------------------------------------------------------------------------------

    async def drain_and_close(self) -> None:
        """Worker stop: release held cluster members, say Draining, cancel running jobs (each reports
        JobFailed{canceled}), wait up to stop_grace_secs for those reports, then close."""
        try:
            for job in [j for j in self.jobs.values() if j.held]:
                await self._release_held(job, "worker draining")
            await self.send(Draining())
            running = [j for j in self.jobs.values() if j.task is not None and not j.task.done()]
            for job in running:
                self._cancel(job, BuildFailureKind.CANCELED, "worker stopping")
            if running:
                await asyncio.wait([j.task for j in running if j.task], timeout=self.config.stop_grace_secs)
            await self.ws.close(1000, "worker stopping")
        except ConnectionClosed:
            pass

    async def abandon_jobs(self) -> None:
        """The session is over: whatever still runs has nobody to report to (the server requeues it)."""
        tasks = []
        for job in list(self.jobs.values()):
            if job.hold is not None:
                job.hold.cancel()
            if job.task is not None and not job.task.done():
                job.cancel_kind = None
                job.task.cancel()
                tasks.append(job.task)
        self.jobs.clear()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
