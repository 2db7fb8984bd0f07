"""The nix executor on this machine's Nix: what each step of a job costs.

A generated flake of N independent /bin/sh derivations (a fresh salt each run, so nothing is cached)
is fetched, evaluated (attributes, then derivations and their closure), and B of its derivations are
built one by one; then a scoring query asks the local store about 1 000 paths (half valid, half
absent), as a worker does for a page of offered candidates. No database is needed.

    .venv/bin/python bench/nix_executor.py [--derivations 200] [--builds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import describe_machine, summary  # noqa: E402
from gradient.core.protocol import (  # noqa: E402
    BuildProgress,
    BuildSpec,
    ClusterAddress,
    ClusterSignalDelivery,
    EvalProgress,
    RepositorySource,
)
from gradient.examples import git_commit_all  # noqa: E402
from gradient.workers.executors.base import JobContext  # noqa: E402
from gradient.workers.executors.nix import NixExecutor  # noqa: E402
from gradient.workers.executors.nix_parse import OFFLINE_NIX_CONFIG  # noqa: E402

FLAKE = """{
  outputs = { self }: {
    packages.x86_64-linux = builtins.listToAttrs (map (i: {
      name = "wide-${toString i}";
      value = builtins.derivation {
        name = "wide-${toString i}"; system = "x86_64-linux"; builder = "/bin/sh"; salt = "@SALT@";
        args = [ "-c" "echo ${toString i} > $out" ];
      };
    }) (builtins.genList (i: i) @N@));
  };
}
"""


class Ctx(JobContext):
    job_id = "eval:bench"
    assignment_id = "bench"
    cluster = None
    roster = []  # noqa: RUF012

    async def progress(self, message: BuildProgress | EvalProgress) -> None:
        pass

    async def send_signal(self, payload: str, to: ClusterAddress | None = None) -> None:
        pass

    async def receive_signal(self, wait_secs: float) -> ClusterSignalDelivery | None:
        return None


async def run(derivations: int, builds: int) -> None:
    environ = {**os.environ, "NIX_CONFIG": os.environ.get("NIX_CONFIG", OFFLINE_NIX_CONFIG)}
    nix = NixExecutor.detect(environ)
    ctx = Ctx()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "wide"
        directory.mkdir()
        text = FLAKE.replace("@SALT@", uuid.uuid4().hex).replace("@N@", str(derivations))
        (directory / "flake.nix").write_text(text)
        commit = git_commit_all(directory, "bench")

        start = time.perf_counter()
        source = await nix.fetch(RepositorySource(url=str(directory), commit=commit), ctx)
        fetched = time.perf_counter()
        attrs = (await nix.evaluate_flake(source, [], ctx)).attrs
        listed = time.perf_counter()
        evaluation = await nix.evaluate_derivations(source, attrs, ctx)
        evaluated = time.perf_counter()
        assert len(evaluation.derivations) == derivations, evaluation.errors

        times = []
        for d in evaluation.derivations[:builds]:
            t0 = time.perf_counter()
            spec = BuildSpec(
                build_id="b", drv_path=d.drv_path, outputs=d.outputs, timeout_secs=60, max_silent_secs=60
            )
            await nix.build(spec, ctx)
            times.append((time.perf_counter() - t0) * 1000)

        present = [o.path for d in evaluation.derivations[:builds] for o in d.outputs]
        # Absent paths in Nix's base32 alphabet (no e, o, t, u).
        absent = [f"/nix/store/{uuid.uuid4().hex.replace('e', 'a')}-absent-{i}" for i in range(500)]
        paths = [*(present * (500 // max(1, len(present)) + 1))[:500], *absent]
        scoring = []
        for _ in range(5):
            t0 = time.perf_counter()
            found = await nix.present_paths(paths)
            scoring.append((time.perf_counter() - t0) * 1000)
        assert found == set(present)

    print(describe_machine())
    print(nix.settings.version)
    print(f"fetch (nix flake metadata, a fresh git repository): {(fetched - start) * 1000:.0f} ms")
    print(f"EvaluateFlake, {derivations} attributes: {(listed - fetched) * 1000:.0f} ms")
    print(
        f"EvaluateDerivations, {derivations} derivations (drv paths, show-derivation -r, path-info): "
        f"{(evaluated - listed) * 1000:.0f} ms"
    )
    print(f"build of one /bin/sh derivation (nix-store --realise, nix path-info): {summary(times)}")
    print(f"scoring query, 1 000 paths ({len(set(present))} distinct valid, 500 absent): {summary(scoring)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--derivations", type=int, default=200)
    parser.add_argument("--builds", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(run(args.derivations, max(1, min(args.builds, args.derivations))))


if __name__ == "__main__":
    main()
