"""A text frame that is no UTF-8 (issue 25, finding 11): a real `serve` closes the socket with 1007, as
RFC 6455 says, logs it as one INFO line without a traceback, and keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.processes import database_env, http_get, serve
from tests.support.rawws import close_code, frame, upgrade

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_text_frame_that_is_no_utf8_is_1007_at_info_without_a_traceback(tmp_path: Path) -> None:
    env = database_env(redis=False)
    with serve(env, tmp_path, ["--no-passes"]) as server:
        for payload in (b"\xff", b'{"type": "InitConnection", "worker_id": "\xc3("}', b"\xed\xa0\x80"):
            sock = upgrade(server.port)
            try:
                sock.sendall(frame(payload))
                assert close_code(sock) == 1007
            finally:
                sock.close()
        # A frame that is text is read as before: a protocol violation (no JSON) is 4400.
        sock = upgrade(server.port)
        try:
            sock.sendall(frame("é, not JSON".encode()))
            assert close_code(sock) == 4400
        finally:
            sock.close()
        assert http_get(f"{server.base_url}/healthz")[0] == 200
        log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[log.find("Traceback") - 300 :][:4000]
    assert log.count("INFO gradient.http: closed a /proto socket of 127.0.0.1:") == 3, log[-3000:]
