"""Worker tokens: shown once, stored hashed, and usable as a command-line argument as they are."""

from __future__ import annotations

import pytest

from gradient.workers.client.config import parse_config
from gradient.workers.tokens import token_hash, token_matches, token_new


def test_no_token_starts_with_a_dash_so_the_worker_command_line_takes_it() -> None:
    # URL-safe base64 starts with "-" one time in 64: in 5 000 tokens that would show ~78 times.
    tokens = [token_new()[0] for _ in range(5000)]
    assert not [t for t in tokens if t.startswith("-")]
    assert len(set(tokens)) == len(tokens)


def test_a_token_matches_only_its_own_hash() -> None:
    token, stored = token_new()
    assert stored == token_hash(token)
    assert token_matches(token, stored)
    assert not token_matches(token + "x", stored)


def test_a_token_starting_with_a_dash_would_be_refused_by_the_worker_command_line() -> None:
    with pytest.raises(SystemExit):
        parse_config(
            ["--server", "ws://h/proto", "--worker-id", "w", "--token", "-abc", "--executor", "sim"],
            environ={},
        )
