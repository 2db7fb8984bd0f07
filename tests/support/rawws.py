"""A WebSocket client over a plain socket, for frames a client library refuses to send (a text frame
that is no UTF-8, say)."""

from __future__ import annotations

import base64
import os
import socket
import struct


def upgrade(port: int, path: str = "/proto", timeout: float = 10.0) -> socket.socket:
    """A socket on 127.0.0.1:`port` whose WebSocket handshake on `path` was accepted (101)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed during the upgrade: {head!r}")
        head += chunk
    if not head.startswith(b"HTTP/1.1 101"):
        sock.close()
        raise ConnectionError(f"upgrade refused: {head[:200]!r}")
    return sock


def frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """One final, masked client frame."""
    mask = os.urandom(4)
    length = len(payload)
    if length < 126:
        header = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
    elif length < 1 << 16:
        header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def close_code(sock: socket.socket, timeout: float = 10.0) -> int | None:
    """Read server frames until a close; its code (None if the socket ended without one)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        while len(data) >= 2:
            opcode, length = data[0] & 0x0F, data[1] & 0x7F
            offset = 2
            if length == 126:
                if len(data) < 4:
                    break
                length, offset = struct.unpack("!H", data[2:4])[0], 4
            elif length == 127:
                if len(data) < 10:
                    break
                length, offset = struct.unpack("!Q", data[2:10])[0], 10
            if len(data) < offset + length:
                break
            payload, data = data[offset : offset + length], data[offset + length :]
            if opcode == 0x8:
                return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return None
        if not chunk:
            return None
        data += chunk
