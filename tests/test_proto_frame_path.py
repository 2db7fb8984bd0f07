"""The direct frame path of a real `serve` (gradient.http_protocol.StrictTextWebSocketProtocol with the
consumer's receive_now): once the handshake is done the protocol reads the frames itself, and what it
does not take (a ping, a fragment, a close, a frame with no mask) goes whole to websockets' parser. Over
a plain socket, so the frames are exactly these bytes: split anywhere, run together, fragmented."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import database_env, http_get, serve
from tests.support.proto import CAPABILITIES, init_connection
from tests.support.rawws import close_code, frame, upgrade

pytestmark = pytest.mark.django_db(transaction=True)

PING, PONG, CLOSE, CONT = 0x9, 0xA, 0x8, 0x0


def _fragment(payload: bytes, opcode: int, fin: bool) -> bytes:
    """One masked client frame, final or not."""
    mask = os.urandom(4)
    head1 = (0x80 if fin else 0) | opcode
    length = len(payload)
    header = (
        struct.pack("!BB", head1, 0x80 | length)
        if length < 126
        else struct.pack("!BBH", head1, 0x80 | 126, length)
    )
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _unmasked(payload: bytes) -> bytes:
    assert len(payload) < 126
    return struct.pack("!BB", 0x81, len(payload)) + payload


class _Frames:
    """The server's frames on a socket, read as they come."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    def next(self, timeout: float = 10.0) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout
        while True:
            if len(self.data) >= 2:
                opcode, length, offset = self.data[0] & 0x0F, self.data[1] & 0x7F, 2
                if length == 126 and len(self.data) >= 4:
                    length, offset = struct.unpack("!H", self.data[2:4])[0], 4
                elif length == 127 and len(self.data) >= 10:
                    length, offset = struct.unpack("!Q", self.data[2:10])[0], 10
                if length < 126 or offset > 2:
                    if len(self.data) >= offset + length:
                        payload = self.data[offset : offset + length]
                        self.data = self.data[offset + length :]
                        return opcode, payload
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame from the server")
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the socket")
            self.data += chunk

    def close_code(self) -> int:
        """The code of the server's close frame, the next frames passed over."""
        while True:
            opcode, payload = self.next()
            if opcode == CLOSE:
                return int(struct.unpack("!H", payload[:2])[0])

    def message(self, kind: str) -> dict[str, Any]:
        """The next text frame of this type (offers and others on the way are passed over)."""
        while True:
            opcode, payload = self.next()
            if opcode == 0x1 and json.loads(payload)["type"] == kind:
                return dict(json.loads(payload))


def _text(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def _slots_become(worker: Any, slots: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        worker.refresh_from_db()
        if worker.max_concurrent_builds == slots:
            return
        time.sleep(0.05)
    raise AssertionError(f"max_concurrent_builds stayed {worker.max_concurrent_builds}, not {slots}")


def _capabilities(slots: int) -> bytes:
    return _text({**CAPABILITIES, "max_concurrent_builds": slots})


def test_frames_split_run_together_fragmented_and_pinged_are_read_in_order(
    tmp_path: Path, make_worker: Any
) -> None:
    worker, token = make_worker()
    env = database_env(redis=False)
    with serve(env, tmp_path, ["--no-passes"]) as server:
        sock = upgrade(server.port)
        frames = _Frames(sock)
        try:
            sock.sendall(frame(_text(init_connection(str(worker.id), token))))
            assert frames.message("InitAck")["type"] == "InitAck"

            # A frame sent a byte at a time: read once whole.
            for byte in frame(_capabilities(3)):
                sock.sendall(bytes([byte]))
                time.sleep(0.001)
            _slots_become(worker, 3)

            # A ping between two frames, all in one write: the pong comes, both frames are read, in order.
            sock.sendall(
                frame(_capabilities(4)) + _fragment(b"are you there", PING, True) + frame(_capabilities(5))
            )
            opcode, payload = frames.next()
            while opcode != PONG:
                opcode, payload = frames.next()
            assert payload == b"are you there"
            _slots_become(worker, 5)

            # A message in three fragments, its last run together with a whole frame after it.
            text = _capabilities(6)
            sock.sendall(_fragment(text[:10], 0x1, False) + _fragment(text[10:20], CONT, False))
            sock.sendall(_fragment(text[20:], CONT, True) + frame(_capabilities(7)))
            _slots_become(worker, 7)

            # And what the protocol reads itself still answers a violation as before: Error, then 4400.
            sock.sendall(frame(b"{not json"))
            assert frames.message("Error")["code"] == 400
            assert frames.close_code() == 4400
        finally:
            sock.close()
        assert http_get(f"{server.base_url}/healthz")[0] == 200
        log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_an_unmasked_frame_is_1002_and_a_close_is_echoed(tmp_path: Path, make_worker: Any) -> None:
    worker, token = make_worker()
    env = database_env(redis=False)
    with serve(env, tmp_path, ["--no-passes"]) as server:
        # A client frame must be masked (RFC 6455 5.1): websockets' parser refuses it, 1002.
        sock = upgrade(server.port)
        try:
            sock.sendall(frame(_text(init_connection(str(worker.id), token))))
            assert _Frames(sock).message("InitAck")["type"] == "InitAck"
            sock.sendall(_unmasked(b'{"type": "RequestJobList"}'))
            assert close_code(sock) == 1002
        finally:
            sock.close()

        # The client closes: its close is echoed with its code, and the frame before it was read. (Its
        # handshake waits for the session the 1002 ended to be closed.)
        sock = upgrade(server.port)
        sock.sendall(frame(_text(init_connection(str(worker.id), token))))
        assert _Frames(sock).message("InitAck")["type"] == "InitAck"
        try:
            sock.sendall(frame(_capabilities(8)) + _fragment(struct.pack("!H", 1000) + b"bye", CLOSE, True))
            assert close_code(sock) == 1000
        finally:
            sock.close()
        _slots_become(worker, 8)
        log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_a_violation_then_a_frame_that_is_no_utf8_in_one_read_is_1007_without_a_traceback(
    tmp_path: Path, make_worker: Any
) -> None:
    """The violation is answered after the socket was closed with 1007 already: nothing more is sent, and
    no failure of ours is logged (it was: uvicorn refuses a send after its close)."""
    worker, token = make_worker()
    env = database_env(redis=False)
    with serve(env, tmp_path, ["--no-passes"]) as server:
        sock = upgrade(server.port)
        try:
            sock.sendall(frame(_text(init_connection(str(worker.id), token))))
            frames = _Frames(sock)
            assert frames.message("InitAck")["type"] == "InitAck"
            sock.sendall(frame(b"{not json") + frame(b"\xff"))
            assert frames.close_code() == 1007
        finally:
            sock.close()
        assert http_get(f"{server.base_url}/healthz")[0] == 200
        log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_a_compressed_session_takes_the_same_path_and_a_zip_bomb_is_1009(
    tmp_path: Path, make_worker: Any
) -> None:
    """The reference worker's client asks for permessage-deflate: its frames are inflated by websockets'
    own extension, in order, and the server's are compressed by it; a frame that inflates past the
    transport's limit closes the socket with 1009, as websockets' parser would."""
    from websockets.sync.client import connect

    from gradient.management.commands.serve import WS_MAX_SIZE

    worker, token = make_worker()
    env = database_env(redis=False)
    with serve(env, tmp_path, ["--no-passes"]) as server:
        with connect(server.ws_url, compression="deflate", open_timeout=10, close_timeout=5) as ws:
            assert ws.protocol.extensions, "permessage-deflate was negotiated"
            ws.send(json.dumps(init_connection(str(worker.id), token)))
            assert json.loads(ws.recv(timeout=10))["type"] == "InitAck"
            for slots in (3, 4):
                ws.send(_capabilities(slots).decode())
                ws.ping().wait(10)  # a ping between frames: its pong comes
                _slots_become(worker, slots)
            ws.send("{not json")
            while (answer := json.loads(ws.recv(timeout=10)))["type"] != "Error":
                assert answer["type"] in ("JobOffer", "JobListChunk"), answer
            assert answer["code"] == 400
        assert ws.close_code == 4400

        with connect(server.ws_url, compression="deflate", max_size=None, open_timeout=10) as ws:
            ws.send(json.dumps(init_connection(str(worker.id), token)))
            assert json.loads(ws.recv(timeout=10))["type"] == "InitAck"
            ws.send(" " * (WS_MAX_SIZE + 1024))  # a few kilobytes on the wire
            try:
                while True:
                    ws.recv(timeout=10)
            except Exception:  # noqa: S110 (the close is what the test reads)
                pass
        assert ws.close_code == 1009
        assert http_get(f"{server.base_url}/healthz")[0] == 200
        log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
