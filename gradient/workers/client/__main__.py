"""`python -m gradient.workers.client`: run the reference worker until SIGTERM (or SIGINT)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from gradient.workers.client.config import ConfigError, forget_secrets, parse_config
from gradient.workers.client.worker import EXIT_CONFIG, Worker
from gradient.workers.executors import ExecutorUnavailable, make_executor


async def _run(worker: Worker) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    return await worker.run()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"gradient worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    forget_secrets(os.environ)
    logging.basicConfig(
        level=getattr(logging, config.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    given = sys.argv[1:] if argv is None else argv
    if any(arg == "--token" or arg.startswith("--token=") for arg in given):
        logging.getLogger("gradient.worker").warning(
            "the token is on the command line, which every user of this host can read (ps): "
            "give it in GRADIENT_WORKER_TOKEN or a file (--token-file) instead"
        )
    try:
        executor = make_executor(
            config.executor, sim_store=config.sim_store or (), sim_build_ms=config.sim_build_ms
        )
    except ExecutorUnavailable as exc:
        print(f"gradient worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return asyncio.run(_run(Worker(config, executor)))


if __name__ == "__main__":
    sys.exit(main())
