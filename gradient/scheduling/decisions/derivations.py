"""A derivation path names one derivation (issue 36, finding 2; protocol.md, "Tenants").

A store derivation's path is a hash of its contents, its system, inputs and outputs among them: two
reports that name one path with another system, other inputs or other outputs cannot both be true.
The first report of a path stored its shared build; a later one that disagrees would otherwise decide
that build for every project (a worker of one project could set another project's build to a system
no worker has, or drop its inputs). So a report that disagrees with the held build is refused, and what
differed is said.

Pure: plain values in, plain values out, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradient.core.protocol import DiscoveredDerivation


def inputs_digest(drv_path: str, input_drvs: Iterable[str]) -> str:
    """What a build keeps of its derivation's inputs: a digest of the set of input derivation paths (the
    path itself left out, as the ingest leaves it out), so that a later report can be compared."""
    inputs = sorted({p for p in input_drvs if p != drv_path})
    return hashlib.sha256("\n".join(inputs).encode()).hexdigest()


def outputs_of(outputs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    return sorted((str(o["name"]), str(o["path"])) for o in outputs)


@dataclass(frozen=True, slots=True)
class HeldDerivation:
    """What the server holds of a derivation path: its shared build's system, outputs and the digest of
    its inputs ("" for a build stored before digests were kept: its inputs are not compared)."""

    system: str
    outputs: list[tuple[str, str]]
    inputs_digest: str


def conflict(reported: DiscoveredDerivation, held: HeldDerivation) -> str | None:
    """None when the reported derivation agrees with the held one; otherwise what differed, in words
    naming the path."""
    path = reported.drv_path
    differed: list[str] = []
    if reported.system != held.system:
        differed.append(f"system {reported.system!r} (held: {held.system!r})")
    if sorted((o.name, o.path) for o in reported.outputs) != held.outputs:
        differed.append("other outputs")
    if held.inputs_digest and inputs_digest(path, reported.input_drvs) != held.inputs_digest:
        differed.append("other input_drvs")
    if not differed:
        return None
    return f"{path} is held with another derivation: this report names it with {', '.join(differed)}"


def conflicts(reported: Iterable[DiscoveredDerivation], held: Mapping[str, HeldDerivation]) -> list[str]:
    """Every conflict of a report's derivations with the held ones, in the report's order."""
    found: list[str] = []
    for d in reported:
        h = held.get(d.drv_path)
        if h is not None and (text := conflict(d, h)) is not None:
            found.append(text)
    return found


def needed_built_elsewhere(
    outputs: Mapping[Any, Iterable[str]],
    needed_by: Iterable[tuple[Any, Any]],
    cached: Mapping[Any, set[str]],
) -> set[Any]:
    """Of the builds `outputs` names (build -> its output paths), those an evaluation of another project
    needs (`needed_by`: (build, project) pairs) whose outputs are not all cached for that project
    (`cached`: project -> the paths cached for it). One project's cached claim must not substitute such a
    build: the other project's evaluation would reopen it to have it built (protocol.md, "Tenants"), and
    the next claim would substitute it again, at the back of the queue each time, for as long as the
    first project kept saying so. Left pending, it is built once, which settles it for every project."""
    return {
        build
        for build, project in needed_by
        if build in outputs and not set(outputs[build]) <= cached.get(project, set())
    }
