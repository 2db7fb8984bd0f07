"""The direct frame path between a /proto socket's protocol (gradient.http_protocol) and its consumer
(gradient.workers.proto.consumer), beside ASGI: both import it from here, neither from the other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# The scope key under which a /proto socket's protocol offers its FramePath to the app.
FRAMES_SCOPE_KEY = "gradient.frames"


class FramePath(Protocol):
    """What a /proto socket offers its consumer beside ASGI: text frames handed over as the socket reads
    them (to `receiver`, which returns False for one it cannot take at once: that one then goes through
    the ASGI queue) and sent as the consumer makes them (`send_text_now`, False where ASGI's send must
    go instead), without the ASGI queue, a task step and a lock per frame."""

    receiver: Callable[[str], bool] | None

    def send_text_now(self, text: str) -> bool: ...
