"""A Celery app with one no-op task, for bench/assign.py's Celery baseline: the same number of no-op
jobs dispatched through Redis to the same number of consumers as the SQL queues get.

The task's only work is to count itself done (one Redis INCR), so the benchmark can see completion
without a result backend. The broker is REDIS_URL; the queue is its own (`bench-noop`), so it never
meets Gradient's passes on the same Redis.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

BROKER = os.environ.get("BENCH_CELERY_BROKER") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/7"
QUEUE = "bench-noop"
DONE_KEY = "bench-noop:done"

app = Celery("bench_noop", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_client: redis.Redis | None = None


def counter() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(BROKER)
    return _client


@app.task(name="bench.noop")
def noop(job: int) -> None:
    counter().incr(DONE_KEY)
