"""The reference worker's log stream: pieces of at most 16 Ki characters with contiguous offsets, the
rest sent on close, a write that never waits for the connection, a bounded buffer whose overflow is
dropped with a marker line; and the sim executor writing a few lines per build."""

from __future__ import annotations

import asyncio
from typing import Any

from gradient.core.protocol import (
    MAX_LOG_PIECE_BYTES,
    AbortJob,
    AssignJob,
    AssignJobResponse,
    BuildLog,
    BuildOutput,
    BuildSpec,
    JobCompleted,
    JobFailed,
    JobUpdate,
    OutputPath,
)
from gradient.workers.client.logs import PIECE_CHARS, LogStream, dropped_line
from gradient.workers.client.worker import EXIT_OK
from gradient.workers.executors.base import ExecutorFailure
from gradient.workers.executors.sim import SimExecutor
from tests.test_workers_client import NOISE, _build_job, _started, _stop, _worker, server  # noqa: F401
from tests.test_workers_executors_sim import Ctx


def _stream(sent: list[BuildLog], **kwargs: object) -> LogStream:
    async def send(message: BuildLog) -> None:
        sent.append(message)

    return LogStream(send, job_id="build:x", assignment_id="a", build_id="b", **kwargs)  # type: ignore[arg-type]


def _joined(sent: list[BuildLog]) -> str:
    text = ""
    for piece in sent:
        assert piece.offset == len(text)  # each piece starts where the last one ended
        text += piece.data
    return text


async def test_what_is_written_arrives_in_order_in_pieces_of_at_most_16_ki_characters() -> None:
    sent: list[BuildLog] = []
    stream = _stream(sent)
    lines = [f"line {i}: {'é' * 50}\n" for i in range(2000)]
    for line in lines:
        stream.write(line)
    await stream.close()
    assert _joined(sent) == "".join(lines)
    assert all(len(p.data) <= PIECE_CHARS and len(p.data.encode()) <= MAX_LOG_PIECE_BYTES for p in sent)
    assert stream.dropped == 0


async def test_a_small_log_is_sent_by_the_timer_before_close() -> None:
    sent: list[BuildLog] = []
    stream = _stream(sent, every_secs=0.01)
    stream.write("hello\n")
    for _ in range(200):
        if sent:
            break
        await asyncio.sleep(0.01)
    assert [p.data for p in sent] == ["hello\n"]
    await stream.close()
    assert _joined(sent) == "hello\n"


async def test_a_stuck_connection_never_blocks_a_write_and_the_overflow_is_dropped_with_a_marker() -> None:
    release = asyncio.Event()
    sent: list[BuildLog] = []

    async def slow_send(message: BuildLog) -> None:
        await release.wait()
        sent.append(message)

    stream = LogStream(
        slow_send, job_id="build:x", assignment_id="a", build_id="b", piece_chars=10, buffer_chars=50
    )
    stream.write("first\n")
    await asyncio.sleep(0.3)  # the first piece is on its way, stuck
    for i in range(100):
        stream.write(f"{i:04d}\n")  # returns at once: never awaits the connection
    assert stream.dropped > 0
    release.set()
    await stream.close()
    text = _joined(sent)
    assert text.startswith("first\n0000\n")
    assert dropped_line(stream.dropped) in text
    kept = [line for line in text.splitlines() if line[:1].isdigit()]
    assert kept == sorted(kept)  # what was kept is in order


async def test_a_gone_connection_ends_the_stream_quietly() -> None:
    async def broken(message: BuildLog) -> None:
        raise ConnectionError("gone")

    stream = LogStream(broken, job_id="build:x", assignment_id="a", build_id="b")
    stream.write("x" * (PIECE_CHARS + 1))
    await stream.close()
    stream.write("after")  # ignored
    assert stream.offset == 0


async def test_the_sim_executor_writes_a_few_lines_per_build_and_says_why_it_failed() -> None:
    executor = SimExecutor(build_ms=1)
    written: list[tuple[str, str]] = []
    ctx = Ctx()
    ctx.build_log = lambda build_id, text: written.append((build_id, text))  # type: ignore[method-assign]
    ok = BuildSpec(
        build_id="b1",
        drv_path="/nix/store/" + "a" * 32 + "-hello.drv",
        outputs=[OutputPath(name="out", path="/nix/store/" + "b" * 32 + "-hello")],
        timeout_secs=0,
        max_silent_secs=0,
    )
    await executor.build(ok, ctx)
    text = "".join(t for b, t in written if b == "b1")
    assert "building '" in text and "installing hello" in text
    failing = BuildSpec(
        build_id="b2",
        drv_path="/nix/store/" + "c" * 32 + "-oops__fail-permanent.drv",
        outputs=[],
        timeout_secs=0,
        max_silent_secs=0,
    )
    try:
        await executor.build(failing, ctx)
    except ExecutorFailure:
        pass
    assert "error: oops: the simulated builder failed" in "".join(t for b, t in written if b == "b2")


# --- The worker over a real loopback WebSocket (the scripted server of test_workers_client) ----------


async def _frames_until(peer: Any, last: type[Any]) -> list[Any]:
    frames = []
    while True:
        message = await peer.recv()
        frames.append(message)
        if isinstance(message, last):
            return frames


async def test_the_whole_log_arrives_before_the_build_output_and_before_a_job_failed(
    server: Any,  # noqa: F811 (the fixture)
) -> None:
    worker = _worker(server)
    task, peer = await _started(server, worker)
    url = "sim:chain?n=2&fail=chain-1"
    await peer.send(AssignJob(job_id="build:0", assignment_id="a0", job=_build_job(url, "chain-0")))
    frames = await _frames_until(peer, JobCompleted)
    logs = [f for f in frames if isinstance(f, BuildLog)]
    output_at = next(
        i for i, f in enumerate(frames) if isinstance(f, JobUpdate) and isinstance(f.update, BuildOutput)
    )
    assert logs and all(frames.index(piece) < output_at for piece in logs)
    text = _joined(logs)
    assert text.startswith("building '") and "installing chain-0" in text
    assert {(p.job_id, p.assignment_id, p.build_id) for p in logs} == {("build:0", "a0", "b-chain-0")}

    await peer.send(AssignJob(job_id="build:1", assignment_id="a1", job=_build_job(url, "chain-1")))
    frames = await _frames_until(peer, JobFailed)
    failed_log = _joined([f for f in frames if isinstance(f, BuildLog)])
    assert "error: chain-1: the simulated builder failed (permanent)" in failed_log
    assert await _stop(worker, task) == EXIT_OK


async def test_an_aborted_builds_log_so_far_arrives_before_its_job_failed(server: Any) -> None:  # noqa: F811
    worker = _worker(server, SimExecutor(build_ms=60_000))
    task, peer = await _started(server, worker)
    await peer.send(AssignJob(job_id="build:0", assignment_id="a0", job=_build_job("sim:wide?n=1", "wide-0")))
    await peer.expect(BuildLog, skip=(*NOISE, AssignJobResponse, JobUpdate))
    await peer.send(AbortJob(job_id="build:0", assignment_id="a0", reason="operator"))
    frames = await _frames_until(peer, JobFailed)
    assert isinstance(frames[-1], JobFailed) and frames[-1].kind == "aborted"
    assert await _stop(worker, task) == EXIT_OK
