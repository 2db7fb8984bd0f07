"""An eval_result in parts that each fit a frame (protocol.md, "Large evaluations").

A frame holds at most 1 MiB, and a DiscoveredDerivation costs about 580 bytes on the wire, so a result
of more than about 1 800 derivations does not fit one. The parts are cut by encoded size, not by
count, each well under the limit (PART_BUDGET_BYTES, room to spare for the envelope), and sent in
order on the same assignment: every part but the last carries `is_final: false`, the last `true`.
Dependencies go first (the derivations in dependency order), so the server can turn most inputs into
edges as the parts arrive; it accepts any order. Warnings and errors go into the first parts (they add
up); one too long for a part is cut.

Only the wire types: the reference worker depends on nothing of the server.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gradient.core.protocol import MAX_FRAME_BYTES, DiscoveredDerivation, EvalResult, JobUpdate

PART_BUDGET_BYTES = 768 * 1024  # a quarter of the frame left for the envelope and ids
MAX_MESSAGE_CHARS = 16 * 1024  # one warning or error

_encoder = msgspec.json.Encoder()


class DerivationTooLarge(ValueError):
    """One derivation alone does not fit a frame: the result cannot be sent."""


def dependencies_first(derivations: Sequence[DiscoveredDerivation]) -> list[DiscoveredDerivation]:
    """The derivations in an order where each comes after those of its inputs that are in the result
    (a derivation named twice: once); otherwise stable."""
    by_path: dict[str, DiscoveredDerivation] = {}
    for d in derivations:
        by_path.setdefault(d.drv_path, d)
    done: set[str] = set()
    out: list[DiscoveredDerivation] = []
    for root in by_path:
        if root in done:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        on_stack = {root}
        while stack:
            path, i = stack[-1]
            inputs = by_path[path].input_drvs
            while i < len(inputs) and (
                inputs[i] in done or inputs[i] not in by_path or inputs[i] in on_stack
            ):
                i += 1
            if i < len(inputs):
                stack[-1] = (path, i + 1)
                stack.append((inputs[i], 0))
                on_stack.add(inputs[i])
                continue
            stack.pop()
            on_stack.discard(path)
            done.add(path)
            out.append(by_path[path])
    return out


def _cut(messages: Sequence[str]) -> list[str]:
    return [m if len(m) <= MAX_MESSAGE_CHARS else m[:MAX_MESSAGE_CHARS] + " [...]" for m in messages]


def eval_result_parts(
    *,
    derivations: Sequence[DiscoveredDerivation],
    warnings: Sequence[str],
    errors: Sequence[str],
    job_id: str = "",
    assignment_id: str = "",
    budget: int = PART_BUDGET_BYTES,
    known_drvs: Sequence[str] = (),
) -> list[EvalResult]:
    """The result as parts, each of whose JobUpdate frames (with these ids) is at most `budget` bytes:
    one part (`is_final` absent) when it fits, else several, the last one final. The derivations the
    server knows (`known_drvs`) go before the derivations, so a derivation naming one as its input finds
    it linked. Raises DerivationTooLarge when a single derivation cannot fit a frame."""
    envelope = len(
        _encoder.encode(
            JobUpdate(
                job_id=job_id,
                assignment_id=assignment_id,
                update=EvalResult(derivations=[], warnings=[], errors=[], is_final=False),
            )
        )
    )
    # `"known_drvs":[]` when a part carries some.
    limit = min(budget, MAX_FRAME_BYTES) - envelope - (len(',"known_drvs":[]') if known_drvs else 0)
    parts: list[EvalResult] = []
    current = EvalResult(derivations=[], warnings=[], errors=[], is_final=False)
    size = 0

    def add(cost: int) -> None:
        nonlocal current, size
        if size and size + cost > limit:
            parts.append(current)
            current = EvalResult(derivations=[], warnings=[], errors=[], is_final=False)
            size = 0
        size += cost

    for message in _cut(errors):
        add(len(_encoder.encode(message)) + 1)
        current.errors.append(message)
    for message in _cut(warnings):
        add(len(_encoder.encode(message)) + 1)
        current.warnings.append(message)
    for path in dict.fromkeys(known_drvs):
        add(len(_encoder.encode(path)) + 1)
        if current.known_drvs is None:
            current.known_drvs = []
        current.known_drvs.append(path)
    for d in dependencies_first(derivations):
        cost = len(_encoder.encode(d)) + 1
        if cost > limit:
            raise DerivationTooLarge(f"{d.drv_path} alone is {cost} bytes on the wire, more than a frame")
        add(cost)
        current.derivations.append(d)
    parts.append(current)
    # One part is a whole result, sent as before (absent means final); several end with a final one.
    parts[-1].is_final = None if len(parts) == 1 else True
    return parts
